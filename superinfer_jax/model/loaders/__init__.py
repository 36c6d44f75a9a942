"""Weight loaders: HF safetensors dirs, GGUF files, orbax checkpoints (see ``superinfer_jax.model.load_model``)."""
