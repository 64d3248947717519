"""The local engine: one frozen base model with LoRA adapters in this process, its batch
scheduler, decoder, keys and values, prefix cache and detokenizer."""
