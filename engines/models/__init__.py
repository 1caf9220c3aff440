"""What a model is before an engine loads it: models.toml's entries (config), where a model's
files come from and where they are kept (sources), the conversions and extractions that make
an engine-ready directory (gguf_convert, model_zip, atomic_dir), dummy models of real shapes
(dummy) and the facts read from a checkpoint's config (model_config). Which models are loaded,
kept and unloaded under the memory budget is the server's registry (server/registry.py)."""
