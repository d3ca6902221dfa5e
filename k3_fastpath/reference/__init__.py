"""The standard path: the whole Kimi K3 text model in PyTorch (kda, mla, moe, attn_res, model)."""
