"""A model's display name: GGUF general.name unless it is a training tag, else the file name."""

from __future__ import annotations

from kvserve.model.names import gguf_display_name, is_training_tag


def test_training_tags_give_way_to_the_file_name():
    assert is_training_tag("Smollm2 135M 8k Lc100K Mix1 Ep2")
    assert gguf_display_name("Smollm2 135M 8k Lc100K Mix1 Ep2",
                             "/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert gguf_display_name("llama-3 sft step12000", "Llama-3-8B-SFT.Q8_0.gguf") == "Llama-3-8B-SFT"


def test_a_real_name_is_kept():
    for name in ("Gemma 3 270m", "Llama 3.1 8B Instruct", "Mixtral 8x7B v0.1", "Qwen2.5 7B"):
        assert not is_training_tag(name)
    assert gguf_display_name("Gemma 3 270m", "gemma-3-270m-q4_k_m.gguf") == "Gemma 3 270m"
    assert gguf_display_name(None, "Foo-7B.Q4_K_M.gguf") == "Foo-7B"
    assert gguf_display_name("  ", "Foo-7B.F16.gguf") == "Foo-7B"


def test_analyze_names_the_bundled_model_by_its_file(bundled_model_path, capsys):
    from kvserve.cli import main
    from kvserve.tools.presets import shape_from_gguf

    assert shape_from_gguf(bundled_model_path).name == "SmolLM2-135M-Instruct"
    assert main(["analyze"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvserve analyze: SmolLM2-135M-Instruct,") and "Ep2" not in out
