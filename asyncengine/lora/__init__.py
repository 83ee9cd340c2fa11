"""Multi-LoRA: PEFT adapters over one base model, several of them in one batch.

`request.py` is what callers name an adapter with (no torch); `peft.py` reads and checks an
adapter directory; `registry.py` is the engine's side (registered adapters, the host-memory
LRU, device slots); `layers.py` computes each projection's LoRA delta per adapter segment.
"""
