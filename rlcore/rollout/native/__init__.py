"""The native engine (`engine.NativeEngine`): batched KV-cache sampling over a Hugging Face causal LM, with its
KV caches, prefill inputs and output rows, and the lean decode step for the Llama family (`lean*`)."""
