"""Model sources: Hugging Face folders, GGUF files, hub ids; tokenizers and chat templates."""
