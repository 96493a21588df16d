r"""Generate text with a k3jax model.

  python -m experiments.generate --checkpoint=runs/small --prompt="def main(" \
      --max_new_tokens=200 --temperature=0.8 --top_p=0.95 --seed=0 --output_json=out.json

--checkpoint: a training run / checkpoint directory of ours, or the output directory of
tools/convert_from_pytorch.py (both load with `k3jax.load_pretrained`). Without --checkpoint,
--preset builds a randomly initialised model (smoke tests). Tokenizer: `tiktoken.model` in the
checkpoint directory (or --tokenizer=PATH) when present — the vocabulary that ships with Kimi
checkpoints, read locally — else our byte tokenizer. --temperature=0 is greedy. --stop may be
repeated (stop strings); --stop_token ids end generation too (default: the tokenizer's EOS).
--speculative uses speculative decoding with the model's MTP layer as the draft, chaining
--draft_len tokens per round (an EAGLE-3 draft when the checkpoint's config has eagle_blocks:
experiments/eagle.py writes one); it prints the acceptance rate.
Tokens are streamed to stdout as they are generated; --output_json writes
{"prompt_tokens": [...], "tokens": [... generated only], "text": "..."}.

Images and videos (a multimodal checkpoint, `config.vision`; e.g. one trained with
configs/tiny_multimodal.py):

  python -m experiments.generate --checkpoint=runs/vision --image=a.png --prompt="" \
      --max_new_tokens=40
  python -m experiments.generate --checkpoint=runs/vision --video=f0.png,f1.png,f2.png

Each --image (repeatable) and then the --video (comma-separated frames, ≤ the tower's
max_frames) is preprocessed (`k3jax.vision.preprocess`: resized to the tower's bounds, padded
to 28 px) into a (t, h, w) patch grid, and the prompt is
    [BOS] [MEDIA] × (h/2)(w/2) per image/video, in order, then the prompt's tokens
— the layout of the shapes corpus (k3jax/data/captions.py) — prefilled in one
`K3Model.extend(..., media=)` call; decoding is text only. --prompt may be empty with media.

Chat (the XTML format, k3jax/data/chat.py):

  python -m experiments.generate --checkpoint=runs/sft --chat --prompt="What is 2+3?" --show_think

--chat renders the prompt as one user turn and opens the assistant's reply —
`[BOS] chat.user_prompt(prompt, thinking)` with the markers as single special tokens, written
by the one chat encoder (k3jax/data/chat_tokens.py: the prompt stays ordinary text, so a typed
`<eos>` or `[open]` is text, never a control token) — in thinking mode (the reply opens its `think` channel) or with --chat_mode=instruct (it opens
`response`). Generation stops at `[end_of_msg]` (added to the stop tokens); the reply is parsed
back (`chat_output`: a reply cut at --max_new_tokens is closed first) and its response channel
printed — after its thinking channel with --show_think, and its tool calls (JSON) when it made
any. A reply that does not parse is printed as raw text with a warning. --output_json gains
"chat": {"think", "response", "tool_calls"} ("text" is then the raw reply, markers written out).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from experiments.model_loading import load_model, load_tokenizer  # noqa: F401 (tests patch)

_CKPT = flags.DEFINE_string("checkpoint", None, "Checkpoint / run / converted directory.")
_PRESET = flags.DEFINE_string("preset", None, "Random-init preset when no --checkpoint.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "File holding the prompt text.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tiktoken.model path (default: auto).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass (1.0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_STOP = flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
_STOP_TOKEN = flags.DEFINE_multi_integer("stop_token", None, "Stop token id (repeatable).")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "Cache capacity (default prompt + new).")
_SPEC = flags.DEFINE_bool("speculative", False, "Speculative decoding (MTP / EAGLE-3 draft).")
_DRAFT_LEN = flags.DEFINE_integer("draft_len", 1, "With --speculative: drafted tokens per round.")
_OUT = flags.DEFINE_string("output_json", None, "Write prompt/generated tokens and text here.")
_IMAGE = flags.DEFINE_multi_string("image", [], "Image file to put before the prompt "
                                   "(repeatable; a multimodal checkpoint).")
_VIDEO = flags.DEFINE_string("video", None, "Comma-separated frame files of one video clip, "
                             "put after the images.")
_CHAT = flags.DEFINE_bool("chat", False, "Render the prompt as a user turn of the XTML chat "
                          "format; print the reply's response channel.")
_CHAT_MODE = flags.DEFINE_enum("chat_mode", None, ["thinking", "instruct"],
                               "With --chat: how the reply opens (default thinking).")
_SHOW_THINK = flags.DEFINE_bool("show_think", False, "With --chat: print the thinking channel too.")


def check_chat_flags(chat: bool, chat_mode: str | None, show_think: bool) -> bool:
  """Whether the reply opens in thinking mode; ValueError naming a flag that needs another."""
  if not chat:
    for name, used in (("--chat_mode", chat_mode is not None), ("--show_think", show_think)):
      if used:
        raise ValueError(f"{name}: only meaningful with --chat")
    return False
  thinking = chat_mode != "instruct"
  if show_think and not thinking:
    raise ValueError("--show_think: --chat_mode=instruct opens the reply at its response "
                     "channel, so there is no thinking channel to show")
  return thinking


def chat_output(generated: str, thinking: bool, show_think: bool):
  """(assistant Message or None, text to print) from the reply's generated text (markers
  written out; cut at [end_of_msg] or at max_new_tokens). A reply that does not parse gives
  (None, the raw text) — the caller warns."""
  from k3jax.data import chat
  try:
    msg = chat.parse_reply(generated, thinking, complete=False)
  except ValueError:
    return None, generated
  parts = []
  if show_think:
    parts += ["--- think ---", msg.think or "", "--- response ---"]
  parts.append(msg.content or "")
  if msg.tool_calls:
    parts += ["--- tools ---", chat.canonical_json([{"name": c.name, "arguments": c.arguments}
                                           for c in msg.tool_calls])]
  return msg, "\n".join(parts)


def media_prompt(cfg, tok, images, video, prompt_ids):
  """(prompt ids with the media template, Media or None); see the module doc. ValueError
  names the flag: a text-only model, an unreadable file, too many frames."""
  if not images and not video:
    return prompt_ids, None
  flag = "--image" if images else "--video"
  if cfg.vision is None:
    raise ValueError(f"{flag}: the model has no vision tower (config.vision is None: a "
                     f"text-only checkpoint); use a multimodal one (configs/tiny_multimodal.py)")
  from k3jax.vision.media import media_from_pixels
  from k3jax.vision.preprocess import preprocess
  items = list(images) + ([[f for f in video.split(",") if f]] if video else [])
  names = [f"--image={p}" for p in images] + ([f"--video={video}"] if video else [])
  try:
    pixel_values, grid = preprocess(cfg.vision, items)
  except ValueError as e:
    msg = str(e)
    for i, n in enumerate(names):     # name the flag instead of preprocess's media[i]
      msg = msg.replace(f"media[{i}]", n)
    raise ValueError(msg) from None
  try:
    media = media_from_pixels(cfg.vision, pixel_values, grid)
  except ValueError as e:
    raise ValueError(f"{flag}: {e}") from None
  bos = getattr(tok, "bos_id", None)
  ids = [] if bos is None else [int(bos)]
  for t, h, w in grid.tolist():
    ids += [cfg.media_placeholder_token_id] * ((h // 2) * (w // 2))
  return ids + list(prompt_ids), media


def main(argv):
  del argv
  from k3jax.serve import generate as G
  from k3jax.serve.sampling import SamplingParams
  from k3jax.serve.speculative import speculative_generate
  if (_PROMPT.value is None) == (_PROMPT_FILE.value is None):
    raise ValueError("exactly one of --prompt / --prompt_file is required")
  thinking = check_chat_flags(_CHAT.value, _CHAT_MODE.value, _SHOW_THINK.value)
  prompt = _PROMPT.value
  if _PROMPT_FILE.value:
    with open(_PROMPT_FILE.value) as f:
      prompt = f.read()
  cfg, variables = load_model(_CKPT.value, _PRESET.value)
  tok = load_tokenizer(_CKPT.value, _TOKENIZER.value, cfg.text.vocab_size)
  if _CHAT.value:
    from k3jax.data import chat
    from k3jax.data.chat_tokens import ChatEncoder
    encoder = ChatEncoder(tok)             # a tokenizer without the markers fails here, by name
    end_id = encoder.end_id
    # The one chat encoder: markers from the structure, the prompt as ordinary text (a typed
    # "<eos>" or "[open]" stays text). media_prompt puts BOS before the media itself.
    ids = encoder.encode(chat.user_conversation(prompt), reply="thinking" if thinking else
                         "instruct", bos=not (_IMAGE.value or _VIDEO.value)).ids.tolist()
  else:
    ids = [int(i) for i in tok.encode(prompt)]
  ids, media = media_prompt(cfg, tok, _IMAGE.value, _VIDEO.value, ids)
  if not ids:
    raise ValueError("--prompt: the prompt encodes to zero tokens")
  stops = tuple(_STOP_TOKEN.value) if _STOP_TOKEN.value is not None else (
      (tok.eos_id,) if getattr(tok, "eos_id", None) is not None else ())
  if _CHAT.value:
    stops = (*stops, end_id)
  sampling = SamplingParams(temperature=_TEMP.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                            stop_tokens=stops, stop_strings=tuple(_STOP.value))
  if not _CHAT.value:                      # chat: the parsed reply is printed at the end
    sys.stdout.write(prompt)
    sys.stdout.flush()
  streamed: list[int] = []

  def on_token(row, token):
    if _CHAT.value:
      return
    # Stream the text increment (decode the whole suffix: multi-byte characters stay intact).
    before = tok.decode(streamed)
    streamed.append(token)
    sys.stdout.write(tok.decode(streamed)[len(before):])
    sys.stdout.flush()

  if _SPEC.value and media is not None:
    raise ValueError("--speculative: not supported with --image/--video (the drafts' prefill "
                     "takes no media)")
  if _SPEC.value:
    out, stats = speculative_generate(cfg, variables, [ids], max_new_tokens=_MAX_NEW.value,
                                      sampling=sampling, seed=_SEED.value, max_len=_MAX_LEN.value,
                                      draft_len=_DRAFT_LEN.value)
    tokens = out[0]
    if not _CHAT.value:
      sys.stdout.write(tok.decode(tokens))
    print(f"\n[speculative] acceptance rate {stats['acceptance_rate']:.3f} over "
          f"{stats['drafts']} drafts, {stats['tokens_per_round']:.2f} tokens per round",
          file=sys.stderr)
    text = tok.decode(tokens)
  else:
    checker_out = G.generate(cfg, variables, [ids], max_new_tokens=_MAX_NEW.value,
                             sampling=sampling, seed=_SEED.value, max_len=_MAX_LEN.value,
                             decode=tok.decode, on_token=on_token, media=media)
    tokens = checker_out[0]
    text = tok.decode(tokens)
    for s in sampling.stop_strings:   # the stop string and what follows are not output
      if s and s in text:
        text = text[:text.find(s)]
  record = {"prompt_tokens": ids, "tokens": tokens, "text": text}
  if _CHAT.value:
    text = tok.decode(tokens, specials=True)
    msg, shown = chat_output(text, thinking, _SHOW_THINK.value)
    if msg is None:
      print("[chat] warning: the reply does not parse as an XTML assistant message; printing "
            "it raw", file=sys.stderr)
    sys.stdout.write(shown)
    record["text"] = text
    record["chat"] = None if msg is None else {
        "think": msg.think, "response": msg.content,
        "tool_calls": None if msg.tool_calls is None else [
            {"name": c.name, "arguments": c.arguments} for c in msg.tool_calls]}
  sys.stdout.write("\n")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(record, f, ensure_ascii=False)


if __name__ == "__main__":
  app.run(main)
