"""The vLLM engine (`engine`), colocated in the trainer's process: what it does to the process, its protocol
in vLLM's terms, whether vLLM can run a model here, and the weight pushes into it. Imported only when asked
for (vllm is an optional dependency)."""
