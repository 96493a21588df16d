"""experiments/generate.py from its flags: greedy generation and MTP speculative decoding on a
random `tiny` model (byte tokenizer) write the same tokens; bad flags are refused."""

import functools
import json

import pytest
from absl import flags

from experiments import generate as cli
# Imported beside generate on purpose: pytest workers import several entry points into one
# process, so their flags share FLAGS (train's --config/--workdir must not be required here).
from experiments import train as _train  # noqa: F401

FLAGS = flags.FLAGS


def _run(tmp_path, name, *extra):
  out = tmp_path / f"{name}.json"
  FLAGS.unparse_flags()
  FLAGS(["generate", "--preset=tiny", "--prompt=K3 says", "--max_new_tokens=5",
         "--temperature=0", "--stop_token=-1", f"--output_json={out}", *extra])
  try:
    cli.main([])
  finally:
    FLAGS.unparse_flags()
  return json.loads(out.read_text())


def test_greedy_and_speculative_write_the_same_tokens(tmp_path, capsys, small_models):
  plain = _run(tmp_path, "plain")
  spec = _run(tmp_path, "spec", "--speculative", "--draft_len=2")
  assert plain["prompt_tokens"] == list(b"K3 says")
  assert len(plain["tokens"]) == 5 and all(0 <= t < 272 for t in plain["tokens"])
  assert spec["tokens"] == plain["tokens"]          # speculative greedy is plain greedy
  assert "acceptance rate" in capsys.readouterr().err


def test_bad_flags(tmp_path):
  FLAGS.unparse_flags()
  FLAGS(["generate", "--preset=tiny"])
  try:
    with pytest.raises(ValueError, match="--prompt"):
      cli.main([])
  finally:
    FLAGS.unparse_flags()


@functools.lru_cache(maxsize=None)
def _small(preset_name):
  """A random 2-layer model of the preset, KDA then MLA (+ its MTP layer): every kind of
  cache, a fraction of the 13-layer compile time."""
  import jax
  import k3jax
  from k3jax.model import K3Model
  cfg = k3jax.preset(preset_name, num_layers=2, mla_every=2)
  return cfg, jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0),
                                         jax.numpy.zeros((1, 4), jax.numpy.int32))


@pytest.fixture
def small_models(monkeypatch):
  monkeypatch.setattr(cli, "load_model", lambda checkpoint, preset_name: _small(preset_name))


def _frames(tmp_path, n, colour=(220, 40, 40)):
  from PIL import Image
  paths = []
  for i in range(n):
    img = Image.new("RGB", (56, 56), (24, 24, 24))
    img.paste(colour, (4 + 8 * i, 10, 20 + 8 * i, 26))
    paths.append(tmp_path / f"frame{i}.png")
    img.save(paths[-1])
  return [str(p) for p in paths]


def test_image_and_video_prompts(tmp_path, small_models):
  """--image / --video on a random tiny_multimodal model: the prompt is [BOS], (h/2)(w/2)
  placeholders per image/clip (a 56 px frame: a 4×4 patch grid → 4), then the prompt text;
  the image and the 2-frame clip share one compiled shape."""
  frames = _frames(tmp_path, 2)
  image = _run(tmp_path, "image", "--preset=tiny_multimodal", f"--image={frames[0]}",
               "--prompt=a ")
  assert image["prompt_tokens"] == [257] + [260] * 4 + list(b"a ")
  assert len(image["tokens"]) == 5
  video = _run(tmp_path, "video", "--preset=tiny_multimodal", f"--video={','.join(frames)}",
               "--prompt=a ")
  assert video["prompt_tokens"] == image["prompt_tokens"]
  empty = _run(tmp_path, "empty", "--preset=tiny_multimodal", f"--image={frames[0]}",
               "--prompt=")           # media alone is a prompt
  assert empty["prompt_tokens"] == [257] + [260] * 4


@pytest.mark.parametrize("extra,match", [
    (["--preset=tiny", "--image={img}"], "--image: the model has no vision tower"),
    (["--preset=tiny_multimodal", "--image={bad}"], r"--image=.*bad\.png"),
    (["--preset=tiny_multimodal", "--video={five}"], "--video=.*5 frames exceed max_frames = 4"),
])
def test_media_errors(tmp_path, extra, match, small_models):
  frames = _frames(tmp_path, 5)
  bad = tmp_path / "bad.png"
  bad.write_text("not an image")
  fill = dict(img=frames[0], bad=str(bad), five=",".join(frames))
  FLAGS.unparse_flags()
  FLAGS(["generate", "--prompt=x", "--max_new_tokens=1", *(e.format(**fill) for e in extra)])
  try:
    with pytest.raises(ValueError, match=match):
      cli.main([])
  finally:
    FLAGS.unparse_flags()


# ---------------------------------------------------------------------- --chat
def test_chat_output_extracts_the_channels():
  """The post-processing of a chat reply (text after the prompt, markers written out)."""
  msg, shown = cli.chat_output("hm[close][open]response[sep]5[close][end_of_msg]x", True, False)
  assert (msg.think, msg.content, shown) == ("hm", "5", "5")
  _, shown = cli.chat_output("hm[close][open]response[sep]5[close][end_of_msg]", True, True)
  assert shown == "--- think ---\nhm\n--- response ---\n5"
  msg, shown = cli.chat_output("cut sho", True, False)            # at max_new_tokens
  assert (msg.think, msg.content, shown) == ("cut sho", None, "")
  msg, shown = cli.chat_output('4[close][open]tools[sep][{"name":"add","arguments":{"a":1}}]'
                               "[close][end_of_msg]", False, False)
  assert shown == '4\n--- tools ---\n[{"arguments":{"a":1},"name":"add"}]'
  msg, shown = cli.chat_output("a[end_of_msg", True, True)        # not a marker: text
  assert msg.think == "a[end_of_msg" and shown == "--- think ---\na[end_of_msg\n--- response ---\n"
  assert cli.chat_output("a[sep]b", True, False) == (None, "a[sep]b")  # does not parse: raw


def _run_chat(tmp_path, name, *extra):
  return _run(tmp_path, name, "--preset=tiny", "--prompt=2+3?", "--chat", *extra)


def test_chat_prompt_stop_token_and_channels(tmp_path, capsys, small_models, monkeypatch):
  """--chat on a random 4-layer tiny model: the prompt is [BOS] + the rendered user turn with
  single-id markers; then, with generation replaced by a fixed reply, [end_of_msg] (264) is a
  stop token and the response (and with --show_think the thinking) channel is printed."""
  out = _run_chat(tmp_path, "chat")
  think_prefix = [261, *b"assistant", 262, 261, *b"think", 262]
  assert out["prompt_tokens"] == [257, 261, *b"user", 262, *b"2+3?", 264, *think_prefix]
  assert len(out["tokens"]) <= 5 and "chat" in out
  instruct = _run_chat(tmp_path, "instruct", "--chat_mode=instruct")
  assert instruct["prompt_tokens"][-10:] == [261, *b"response", 262]

  from k3jax.serve import generate as G
  from k3jax.data.tokenizers import ByteTokenizer
  seen = {}
  reply = ByteTokenizer().encode("hm[close][open]response[sep]5[close]", specials=True).tolist()

  def fake_generate(cfg, variables, prompts, sampling, **kw):
    seen["stops"] = sampling.stop_tokens
    return [reply]

  monkeypatch.setattr(G, "generate", fake_generate)
  capsys.readouterr()
  out = _run_chat(tmp_path, "fake", "--show_think")
  assert seen["stops"] == (-1, 264)
  assert capsys.readouterr().out == "--- think ---\nhm\n--- response ---\n5\n"
  assert out["chat"] == {"think": "hm", "response": "5", "tool_calls": None}


def test_chat_prompt_keeps_typed_control_tokens_as_text(tmp_path, small_models):
  """A user typing a special token's name (`<eos>`, `[open]`, `<media>`) gets its bytes:
  the prompt's only control ids are BOS and the markers of the structure."""
  out = _run(tmp_path, "adv", "--chat", "--prompt=a<eos>[open]<media>", "--max_new_tokens=1")
  ids = out["prompt_tokens"]
  assert [t for t in ids if t >= 256] == [257, 261, 262, 264, 261, 262, 261, 262]
  assert bytes(t for t in ids if t < 256).startswith(b"usera<eos>[open]<media>assistant")


@pytest.mark.parametrize("extra,match", [
    (["--show_think"], "--show_think: only meaningful with --chat"),
    (["--chat_mode=instruct"], "--chat_mode: only meaningful with --chat"),
    (["--chat", "--chat_mode=instruct", "--show_think"], "--show_think: .*no thinking channel"),
])
def test_chat_flag_errors(extra, match):
  FLAGS.unparse_flags()
  FLAGS(["generate", "--preset=tiny", "--prompt=x", *extra])
  try:
    with pytest.raises(ValueError, match=match):
      cli.main([])
  finally:
    FLAGS.unparse_flags()
