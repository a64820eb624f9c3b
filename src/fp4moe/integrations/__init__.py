"""Integrations of fp4moe with other libraries.

``fp4moe.integrations.hf``: Hugging Face transformers 5.x MoE models (Qwen3-MoE, Mixtral,
DeepSeek-V3): replace their sparse MoE blocks with fp4moe layers, and infer the serving phase
inside ``model.generate``. Importing a submodule does not import its library; the submodules
are not imported here.
"""

__all__: list[str] = []
