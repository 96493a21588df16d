"""The release's tensor dtypes: the one table export writes from and `--check_only` compares with.

`RELEASE_DTYPES` gives, for every released tensor name, the dtype the K3 release stores it in
and where that comes from: a section of docs/k3.md, a public fact about the published files,
or k3jax's choice where neither says. The first rule whose pattern matches (`re.search`) wins.
  * export: "uint8" and "float32" entries are written so; "bfloat16" entries in the export's
    `--dtype` (bf16 by default, the release's; float32 writes fp32 masters exactly).
  * import: the table is a comparison, never a gate. Any float dtype (bf16, fp16, fp32, fp8)
    loads and is converted to the model's parameter dtype, each conversion listed; a float
    tensor whose dtype differs from the table is a warning (`pipeline.dtype_report`). Only the
    MXFP4 bytes are checked exactly (uint8, shapes): they are not floats at all.

The router (`block_sparse_moe.gate.weight`, 92 layers × 896 × 7168) is the one dtype the
published size decides: the release is 1.561 TB (decimal). Its 497,220 tensors with every dtype
as in this table come to 1,560,860,324,864 bytes (1.5609 TB: the published 1.561); with fp32
router matrices (+590,872,576 × 2 bytes) they would be 1,562,042,070,016 (1.5620 TB, published
as 1.562). So bf16. The norm weights and AttnRes vectors (4,400,128 values) are too small for
the size to tell (8.8 MB more in fp32, below the published figure's last digit): bf16 is
k3jax's choice, as §12's accounting assumes and as the release's one published norm, the
vision tower's `final_layernorm`, is.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class DtypeRule:
  pattern: str   # re.search on the released tensor name
  dtype: str     # numpy name: "uint8", "float32" or "bfloat16"
  source: str    # where the dtype comes from


RELEASE_DTYPES: tuple[DtypeRule, ...] = (
    DtypeRule(r"\.weight_(packed|scale)$", "uint8",
              "docs/k3.md §9 and public: routed experts' MXFP4 bytes and E8M0 scales are U8"),
    DtypeRule(r"\.A_log$", "float32",
              "docs/k3.md §9/§12 and public: A_log is F32 [128] (read from the first shard)"),
    DtypeRule(r"\.dt_bias$", "float32", "docs/k3.md §9: dt_bias fp32"),
    DtypeRule(r"_conv1d\.weight$", "float32", "docs/k3.md §9: the KDA short convs fp32"),
    DtypeRule(r"\.o_norm\.weight$", "float32", "docs/k3.md §9: o_norm fp32"),
    DtypeRule(r"\.e_score_correction_bias$", "float32", "docs/k3.md §9: the router bias fp32"),
    DtypeRule(r"\.block_sparse_moe\.gate\.weight$", "bfloat16",
              "size evidence (docs/k3.md §12): 1.561 TB published; bf16 routers give 1.5609 TB, "
              "fp32 ones 1.5620 TB"),
    DtypeRule(r"^(vision_tower|mm_projector)\.", "bfloat16",
              "docs/k3.md §11 and public: the vision tensors are BF16 (patch_embed.proj, pos_emb, "
              "wqkv, final_layernorm)"),
    DtypeRule(r"(norm|_res_proj)\.weight$", "bfloat16",
              "k3jax's choice: norms and AttnRes vectors bf16, as docs/k3.md §12's accounting "
              "assumes and as the vision final_layernorm is (the size cannot tell: 8.8 MB)"),
    DtypeRule(r"", "bfloat16",
              "docs/k3.md §12 and public: every other float tensor BF16 (q_a_proj, q_b_proj, "
              "kv_a_proj_with_mqa, kv_b_proj, g_proj published as BF16)"),
)

_STORE_ENTRY = "bfloat16"   # written in the export's --dtype


@functools.lru_cache(maxsize=None)
def _compiled() -> tuple[tuple[re.Pattern, DtypeRule], ...]:
  return tuple((re.compile(r.pattern), r) for r in RELEASE_DTYPES)


def release_rule(name: str) -> DtypeRule:
  """The table's rule for a released tensor name (the last one matches everything)."""
  for pattern, rule in _compiled():
    if pattern.search(name):
      return rule
  raise AssertionError("RELEASE_DTYPES ends with a rule matching every name")


def release_dtype(name: str) -> np.dtype:
  """The dtype the release stores tensor `name` in."""
  return _numpy(release_rule(name).dtype)


def export_dtype(name: str, store) -> np.dtype:
  """What export writes tensor `name` as: the table's dtype, `store` (--dtype) for its bf16
  entries."""
  dtype = release_rule(name).dtype
  return np.dtype(store) if dtype == _STORE_ENTRY else _numpy(dtype)


def _numpy(name: str) -> np.dtype:
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


__all__ = ["DtypeRule", "RELEASE_DTYPES", "release_rule", "release_dtype", "export_dtype"]
