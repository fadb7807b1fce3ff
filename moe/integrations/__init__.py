"""Optional bridges to other libraries, never imported by the core package.

``moe.integrations.hf``: this package's routers inside Hugging Face transformers MoE models
(needs the ``[hf]`` extra).
"""
