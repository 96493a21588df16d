"""Image/video preprocessing → (pixel_values, grid_thw) (docs/k3.md §11; k3jax/vision/preprocess.py)."""

import ast
import io
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from k3jax.vision import fit_size, load_image, preprocess, vision_preset

CFG = vision_preset("moonvit_v2")


def _rand_image(h, w, seed=0, mode="RGB"):
  rng = np.random.default_rng(seed)
  return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)


def _png_bytes(img):
  buf = io.BytesIO()
  img.save(buf, format="PNG")
  return buf.getvalue()


def _reference(rgb_frames, p=14):
  """Explicit loops: frames uint8 [t][H, W, 3] (already resized) → patches in (t, row, col)
  order, zero-padded to a multiple of 28, normalised with mean = std = 0.5."""
  t = len(rgb_frames)
  hh, ww = rgb_frames[0].shape[:2]
  ph, pw = -(-hh // 28) * 28, -(-ww // 28) * 28
  out = []
  for f in range(t):
    for r in range(ph // p):
      for c in range(pw // p):
        patch = np.full((3, p, p), -1.0, np.float64)  # padding: 0 → (0 − 0.5) / 0.5
        for ch in range(3):
          for y in range(p):
            for x in range(p):
              yy, xx = r * p + y, c * p + x
              if yy < hh and xx < ww:
                patch[ch, y, x] = (rgb_frames[f][yy, xx, ch] / 255.0 - 0.5) / 0.5
        out.append(patch)
  return np.stack(out), (t, ph // p, pw // p)


def test_patch_order_and_values_against_a_numpy_loop():
  a, b = _rand_image(30, 45, seed=1), _rand_image(28, 14, seed=2)  # under budget: no resize
  pv, grid = preprocess(CFG, [a, _png_bytes(b)])
  assert pv.dtype == np.float32 and pv.shape[1:] == (3, 14, 14)
  assert grid.dtype == np.int32 and grid.tolist() == [[1, 4, 4], [1, 2, 2]]
  ra, ga = _reference([np.asarray(a)])
  rb, gb = _reference([np.asarray(b)])
  assert [list(ga), list(gb)] == grid.tolist()
  np.testing.assert_allclose(pv, np.concatenate([ra, rb]), rtol=0, atol=1e-6)


def test_resize_keeps_aspect_ratio_and_pads_to_28():
  for (h, w), budget in [((300, 1000), 256), ((1000, 301), 256), ((777, 555), 100),
                         ((4000, 3000), 65536), ((20, 9000), 65536), ((9000, 20), 65536)]:
    (rh, rw), (ph, pw) = fit_size(h, w, max_patches=budget, max_side=512,
                                  limit_patches=budget, limit_side=512)
    assert rh <= h and rw <= w                       # never upscales
    assert ph % 28 == 0 and pw % 28 == 0 and 0 <= ph - rh < 28 and 0 <= pw - rw < 28
    assert (ph // 14) * (pw // 14) <= budget and max(ph, pw) // 14 <= 512
    # One scale for both sides: the shorter side is within one patch (14 px) of the longer
    # side's scale applied to it.
    s = rw / w if w >= h else rh / h
    assert abs(rh - h * s) <= 14 and abs(rw - w * s) <= 14, (h, w, rh, rw)
  # Through preprocess: the grid is the padded size / 14 and the resize is Pillow BICUBIC.
  img = _rand_image(300, 1000, seed=3)
  pv, grid = preprocess(CFG, [img], max_patches=256)
  (rh, rw), (ph, pw) = fit_size(300, 1000, max_patches=256)
  assert grid.tolist() == [[1, ph // 14, pw // 14]]
  ref, _ = _reference([np.asarray(img.resize((rw, rh), Image.Resampling.BICUBIC))])
  np.testing.assert_allclose(pv, ref, rtol=0, atol=1e-6)


def test_small_images_are_padded_not_upscaled():
  (rh, rw), (ph, pw) = fit_size(5, 3)
  assert (rh, rw, ph, pw) == (5, 3, 28, 28)
  pv, grid = preprocess(CFG, [_rand_image(5, 3)])
  assert grid.tolist() == [[1, 2, 2]] and pv.shape == (4, 3, 14, 14)
  assert np.all(pv[1:] == -1.0) and np.all(pv[0][:, 5:, :] == -1.0)


def test_padding_overflow_shrinks_into_the_budget():
  # navit_resize keeps 3590×3590 (256×256 floor patches) and pads to 3612 = 258 patches a side,
  # over the 65,536-patch budget: with the limits set fit_size shrinks it into the budget.
  assert fit_size(3590, 3590) == ((3590, 3590), (3612, 3612))  # no limits: transformers
  (rh, rw), (ph, pw) = fit_size(3590, 3590, limit_patches=65536, limit_side=512)
  assert (ph // 14) * (pw // 14) <= 65536 and rh == rw and ph == pw
  assert fit_size(3584, 3584, limit_patches=65536) == ((3584, 3584), (3584, 3584))
  # preprocess applies the config's bounds as limits (tiny: ≤ 32 patches a side, ≤ 1024).
  cfg = vision_preset("tiny_moonvit_v2", max_patches_per_frame=256)
  _, grid = preprocess(cfg, [_rand_image(16 * 14 + 5, 16 * 14 + 5)])
  assert grid.tolist() == [[1, 16, 16]]
  # A K2.5-style smaller budget keeps transformers' (overflowing) size: here 1024 → 34×34.
  _, grid = preprocess(CFG, [_rand_image(32 * 14 + 5, 32 * 14 + 5)], max_patches=1024)
  assert grid.tolist() == [[1, 34, 34]]


def test_normalisation_and_rgb_conversion():
  grey = Image.new("L", (28, 28), 51)
  pv, _ = preprocess(CFG, [grey])
  np.testing.assert_allclose(pv, (51 / 255 - 0.5) / 0.5, atol=1e-6)
  # Transparent pixels composite onto white, like transformers' convert_to_rgb.
  rgba = Image.new("RGBA", (28, 28), (0, 0, 0, 0))
  pv, _ = preprocess(CFG, [rgba])
  np.testing.assert_allclose(pv, 1.0, atol=1e-6)
  assert load_image(_png_bytes(Image.new("P", (3, 3)))).mode == "RGB"


def test_path_input(tmp_path):
  img = _rand_image(40, 20, seed=4)
  path = tmp_path / "x.png"
  img.save(path)
  for src in (path, str(path)):
    pv, grid = preprocess(CFG, [src])
    ref, g = _reference([np.asarray(img)])
    assert grid.tolist() == [list(g)]
    np.testing.assert_allclose(pv, ref, atol=1e-6)


def test_jpeg_bytes():
  buf = io.BytesIO()
  _rand_image(50, 60, seed=5).save(buf, format="JPEG")
  pv, grid = preprocess(CFG, [buf.getvalue()])
  ref, g = _reference([np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))])
  assert grid.tolist() == [list(g)]
  np.testing.assert_allclose(pv, ref, atol=1e-6)


def test_video_frames_are_one_sample_in_t_row_col_order():
  frames = [_rand_image(30, 44, seed=10 + k) for k in range(3)]
  img = _rand_image(14, 14, seed=20)
  pv, grid = preprocess(CFG, [img, frames])
  assert grid.tolist() == [[1, 2, 2], [3, 4, 4]]
  ri, _ = _reference([np.asarray(img)])
  rv, _ = _reference([np.asarray(f) for f in frames])
  np.testing.assert_allclose(pv, np.concatenate([ri, rv]), atol=1e-6)
  # Frames of different sizes that resize to the same size are accepted.
  big = [_rand_image(600, 400, seed=1), _rand_image(600, 400, seed=2)]
  _, grid = preprocess(CFG, [big], max_patches=64)
  (_, _), (ph, pw) = fit_size(600, 400, max_patches=64)
  assert grid.tolist() == [[2, ph // 14, pw // 14]]


def test_encode_accepts_the_output():
  import jax
  from k3jax.vision import encode, init_vision
  cfg = vision_preset("tiny_moonvit_v2")
  pv, grid = preprocess(cfg, [_rand_image(30, 44, seed=7), [_rand_image(20, 20)] * 2])
  assert grid.tolist() == [[1, 4, 4], [2, 2, 2]]
  variables = init_vision(cfg, jax.random.PRNGKey(0))
  out = encode(cfg, variables, pv, grid)
  assert out.shape[0] == 4 + 1


# ------------------------------------------------------------------------------ errors
def test_error_corrupt_and_unreadable_files(tmp_path):
  bad = tmp_path / "corrupt.png"
  bad.write_bytes(_png_bytes(_rand_image(40, 40))[:60])  # truncated PNG
  with pytest.raises(ValueError, match=r"media\[1\].*corrupt\.png.*cannot read or decode"):
    preprocess(CFG, [_rand_image(14, 14), bad])
  with pytest.raises(ValueError, match=r"media\[0\].*missing\.png.*cannot read or decode"):
    preprocess(CFG, [tmp_path / "missing.png"])
  with pytest.raises(ValueError, match=r"media\[0\].*bytes.*cannot read or decode"):
    preprocess(CFG, [b"not an image at all"])
  with pytest.raises(ValueError, match=r"media\[0\].*expected a path, bytes or a PIL"):
    preprocess(CFG, [np.zeros((14, 14, 3), np.uint8)])
  with pytest.raises(ValueError, match=r"media: expected a list"):
    preprocess(CFG, "x.png")
  with pytest.raises(ValueError, match=r"media: expected at least one"):
    preprocess(CFG, [])


def _png_header_only(w, h):
  import struct
  import zlib

  def chunk(t, d):
    return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
          + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_error_zero_size_image():
  with pytest.raises(ValueError, match=r"media\[0\].*zero-size image \(0×5 pixels\)"):
    preprocess(CFG, [Image.new("RGB", (0, 5))])
  # A 0×5 PNG as bytes: Pillow refuses to identify it, reported as undecodable.
  with pytest.raises(ValueError, match=r"media\[0\].*bytes.*(cannot read or decode|zero-size)"):
    preprocess(CFG, [_png_header_only(0, 5)])


def test_error_video_frames():
  f = _rand_image(28, 28)
  with pytest.raises(ValueError, match=r"media\[0\]: 5 frames exceed max_frames = 4"):
    preprocess(CFG, [[f] * 5])
  with pytest.raises(ValueError, match=r"media\[0\]: a video needs at least one frame"):
    preprocess(CFG, [[]])
  with pytest.raises(ValueError, match=r"media\[1\] frame 2 .*frames of different sizes"):
    preprocess(CFG, [f, [f, f, _rand_image(28, 42)]])
  with pytest.raises(ValueError, match=r"media\[0\] frame 1 .*cannot read or decode"):
    preprocess(CFG, [[f, b"junk"]])


def test_error_grid_over_the_config_bound():
  # A budget beyond the config's RoPE/position bound: check_grid rejects the resized grid.
  cfg = vision_preset("tiny_moonvit_v2")  # max_grid_side = 32
  with pytest.raises(ValueError, match=r"media\[0\]: the resized grid .*max_grid_side = 32"):
    preprocess(cfg, [_rand_image(28, 40 * 14)], max_side=64)
  with pytest.raises(ValueError, match=r"cannot hold one 2×2 merge window"):
    preprocess(CFG, [_rand_image(28, 28)], max_patches=3)


# ------------------------------------------------------------------- transformers parity
def _transformers_navit_resize():
  """transformers' K2.5 `navit_resize`, taken from the source without importing the module
  (it imports torchvision, which the venv may lack)."""
  import transformers
  src = Path(transformers.__file__).parent / "models/kimi_k25/image_processing_kimi_k25.py"
  tree = ast.parse(src.read_text())
  fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize"]
  ns = {"math": math}
  exec(compile(ast.Module(body=fn, type_ignores=[]), str(src), "exec"), ns)
  return ns["navit_resize"]


def test_fit_size_matches_transformers_navit_resize():
  navit_resize = _transformers_navit_resize()
  rng = np.random.default_rng(0)
  sizes = [(1, 1), (5, 3), (14, 14), (3584, 3584), (7168, 20), (20, 7168), (1080, 1920)]
  sizes += [tuple(int(v) for v in rng.integers(1, 8000, 2)) for _ in range(300)]
  checked = 0
  for budget, side in [(65536, 512), (16384, 512), (4096, 512), (256, 64)]:
    for h, w in sizes:
      ref = navit_resize(h, w, patch_size=14, merge_kernel_size=2, max_patches=budget,
                         max_size_per_side=side)
      assert fit_size(h, w, max_patches=budget, max_side=side) == ref, (h, w, budget, side)
      (ph, pw) = ref[1]
      if (ph // 14) * (pw // 14) <= budget and max(ph, pw) // 14 <= side:  # no overflow
        assert fit_size(h, w, max_patches=budget, max_side=side, limit_patches=budget,
                        limit_side=side) == ref
        checked += 1
  assert checked > 200
