"""PyTorch (Moonshot / Hugging Face layout) ⇄ k3jax checkpoint conversion.

`convert(src, dst, ...)` and `export(src, dst, ...)` (k3jax/convert/pipeline.py); the tensor map
is k3jax/convert/names.py, streaming safetensors I/O k3jax/convert/safetensors_io.py.
"""

from k3jax.convert.pipeline import convert, export

__all__ = ["convert", "export"]
