"""The KV cache: block pool, manager, storage, sizing. Imports nothing of engine/ or model/."""
