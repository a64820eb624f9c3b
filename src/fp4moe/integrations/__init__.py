"""Integrations of fp4moe with other libraries.

Hugging Face transformers 5.x MoE models (Qwen3-MoE, Mixtral, DeepSeek-V3):

- ``hf``: the entry points (``load_model``, ``convert``, ``convert_block``, ``moe_layers``,
  ``set_policy``, the phase hooks);
- ``hf_blocks``: the supported blocks and ``FP4MoEBlock``; ``hf_phases``: the serving phase
  of each model call; ``hf_load``: checkpoint folders to models; ``hf_save``: what
  ``save_pretrained`` writes; ``hf_export``: whole models written as NVFP4 checkpoints;
  ``hf_quantizer``: transformers' ``from_pretrained`` quantizer (registered on import).

Importing a submodule imports transformers only where it needs it (``hf_quantizer`` at
once, the others when a model is built); the submodules are not imported here.
docs/integration.md walks through a model's life with them.
"""

__all__: list[str] = []
