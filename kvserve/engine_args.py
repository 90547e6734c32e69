"""The engine's command-line flags, shared by `kvserve generate/chat` (kvserve/cli.py) and
`kvserve serve` (server/cli.py): one flag per EngineConfig field, and the LLM they describe."""

from __future__ import annotations

import argparse
import dataclasses

from kvserve.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with the help text declared there."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineConfig):
        meta = dict(f.metadata)
        group = meta.pop("group", None)
        target = p if group is None else groups.setdefault(group, p.add_argument_group(group))
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        target.add_argument(flag, dest=f.name, **_flag_kwargs(f, meta))


def _flag_kwargs(f: dataclasses.Field, meta: dict) -> dict:
    """argparse keywords for one config field."""
    kwargs = {"help": meta.pop("help"), **meta}
    if f.default is True:
        return {**kwargs, "action": "store_false", "default": True}
    if f.default is False:
        return {**kwargs, "action": "store_true", "default": False}
    if f.name == "kv_tiers":
        return {**kwargs, "action": "append", "default": None}
    kwargs.setdefault("type", type(f.default) if f.default is not None else _optional_type(f))
    return {**kwargs, "default": f.default}


def _optional_type(f: dataclasses.Field):
    text = str(f.type)
    return int if text.startswith("int") else float if text.startswith("float") else str


def engine_kwargs(args) -> dict:
    """LLM(...) keyword arguments from parsed engine flags."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def make_llm(args):
    """Build an LLM from parsed engine arguments."""
    from kvserve.llm import LLM
    return LLM(**engine_kwargs(args))
