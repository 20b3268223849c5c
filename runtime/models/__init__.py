"""One model file per architecture family, with Hugging Face parameter names."""
