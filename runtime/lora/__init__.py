"""LoRA adapters: the hand-off record every layer reads (`params`)."""
