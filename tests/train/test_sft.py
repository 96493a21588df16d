"""SFT data (k3jax/data/sft.py): JSONL schema and its errors, the assistant loss mask against a
reference built from each message's own rendering, packing (whole conversations, segment ids,
too-long ones counted), deterministic batches, and the trainer: bit-exact resume, train.init.

The trainer runs share one config (1-layer `tiny`, rows of 96 tokens), so the step compiles
once for the file."""

import json

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.data import chat
from k3jax.data import tokenizers
from k3jax.data import sft
from k3jax.train import trainer
from k3jax.train.run import base_config, run_config

ASSISTANT = {"role": "assistant", "think": "t", "response": "r",
             "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
GOOD = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     ASSISTANT, {"role": "tool", "content": "1"},
                     {"role": "assistant", "response": "done"}],
        "options": {"effort": "high", "tools": [{"name": "f", "description": "d",
                                                 "parameters": {"x": "int"}}]}}


# ---------------------------------------------------------------------- schema
def test_schema_maps_onto_the_conversation(tmp_path):
  conv = sft.conversation_from_json(GOOD)
  assert conv == chat.Conversation(
      (chat.Message("system", "s"), chat.Message("user", "u"),
       chat.Message("assistant", "r", "t", (chat.ToolCall("f", {"x": 1}),)),
       chat.Message("tool", "1"), chat.Message("assistant", "done")),
      chat.Options((chat.ToolSpec("f", "d", {"x": "int"}),), "high"))
  assert sft.conversation_to_json(conv) == GOOD
  # "content" is the response channel of an assistant; "" is a present, empty channel.
  alias = sft.conversation_from_json({"messages": [{"role": "assistant", "content": ""}]})
  assert alias.messages[0] == chat.Message("assistant", "", None, None)
  path = tmp_path / "c.jsonl"
  sft.write_jsonl(str(path), [conv, alias])
  text = path.read_text().replace("\n", "\n\n", 1)       # a blank line is skipped
  path.write_text(text)
  assert sft.read_jsonl(str(path)) == [conv, alias]


def _msgs(*m):
  return {"messages": list(m)}


USER = {"role": "user", "content": "u"}
BAD = [
    ("[1, 2]", "line: expected a JSON object, found list"),
    ("{not json", "not valid JSON"),
    (_msgs(), "messages: expected a non-empty list"),
    ({"msgs": []}, "unknown key(s) ['msgs']"),
    ({"options": {}}, "missing key 'messages'"),
    (_msgs(USER, {"role": "bot", "content": "x"}), "messages[1].role: expected one of"),
    (_msgs(USER, {"content": "x"}), "messages[1]: missing key 'role'"),
    (_msgs(USER, {"role": ["user"], "content": "x"}), "messages[1].role: expected one of"),
    (_msgs({"role": "user", "content": 3}, ASSISTANT), "messages[0].content: expected a string"),
    (_msgs({"role": "user"}, ASSISTANT), "messages[0]: missing key 'content'"),
    (_msgs(USER, {"role": "user", "content": "x", "think": "t"}),
     "messages[1]: unknown key(s) ['think'] for a user message"),
    (_msgs(USER, {"role": "assistant"}), "messages[1]: an assistant message needs at least one"),
    (_msgs(USER, {"role": "assistant", "response": "a", "content": "b"}),
     "messages[1]: both 'content' and 'response'"),
    (_msgs(USER, {"role": "assistant", "think": 1}), "messages[1].think: expected a string"),
    (_msgs(USER, {"role": "assistant", "tool_calls": {"name": "f"}}),
     "messages[1].tool_calls: expected a list, found object"),
    (_msgs(USER, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": [1]}]}),
     "messages[1].tool_calls[0].arguments: expected an object, found list"),
    (_msgs(USER, {"role": "assistant", "tool_calls": [{"name": "", "arguments": {}}]}),
     "messages[1].tool_calls[0].name: expected a non-empty string"),
    (_msgs({"role": "user", "content": "a[close]b"}, ASSISTANT),
     "messages[0] (user): the text holds the marker '[close]' at offset 1"),
    (_msgs(USER, {"role": "assistant", "response": "[end_of_msg]"}),
     "messages[1] (assistant response): the text holds the marker"),
    (_msgs(USER), "messages: no assistant message"),
    ({**_msgs(USER, ASSISTANT), "options": {"effort": "huge"}}, "options: Options.effort"),
    ({**_msgs(USER, ASSISTANT), "options": []}, "options: expected an object, found list"),
    ({**_msgs(USER, ASSISTANT), "turn_options": {}}, "turn_options: not supported"),
]


@pytest.mark.parametrize("line,message", BAD)
def test_schema_errors_name_line_and_field(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  good = json.dumps(GOOD)
  path.write_text(f"{good}\n\n{line if isinstance(line, str) else json.dumps(line)}\n{good}\n")
  with pytest.raises(ValueError) as e:
    sft.read_jsonl(str(path))
  assert str(e.value).startswith(f"{path}:3: "), str(e.value)     # blank line 2 still counts
  assert message in str(e.value), str(e.value)


def test_missing_and_empty_files(tmp_path):
  with pytest.raises(ValueError, match="data.sft_file: cannot read"):
    sft.read_jsonl(str(tmp_path / "none.jsonl"))
  (tmp_path / "e.jsonl").write_text("\n\n")
  with pytest.raises(ValueError, match="holds no conversation"):
    sft.read_jsonl(str(tmp_path / "e.jsonl"))


# ---------------------------------------------------------------------- mask
# Texts without '<' (ByteTokenizer.encode(specials=True), the reference, would read "<bos>").
TEXT = st.text(st.sampled_from(list("ab [/]{}\"é\n0")), max_size=6)
CALLS = st.lists(st.builds(chat.ToolCall, st.sampled_from(["f", "g"]),
                           st.dictionaries(st.sampled_from(["x", "y"]), TEXT, max_size=2)),
                 max_size=2).map(tuple)
ASSISTANTS = st.builds(lambda c, t, k: chat.Message("assistant", c, t, k),
                       st.none() | TEXT, st.none() | TEXT, st.none() | CALLS)
OTHERS = st.builds(chat.Message, st.sampled_from(["system", "user", "tool"]), TEXT)
CONVS = st.builds(
    lambda ms, opts: chat.Conversation(tuple(ms), opts),
    st.lists(ASSISTANTS | OTHERS, min_size=1, max_size=5),
    st.none() | st.builds(chat.Options, st.just(()), st.sampled_from([None, "low", "max"])))


def reference_mask(conv):
  """[BOS], then each block's own rendering, encoded by the byte tokenizer's specials; an
  assistant message's tokens after its 11-token header `[open]assistant[sep]` are masked."""
  tok = tokenizers.ByteTokenizer()
  header = len(tok.encode("[open]assistant[sep]", specials=True))
  ids, mask = [tokenizers.BOS], [False]
  if conv.options is not None:
    block = tok.encode(f"[open]options[sep]{conv.options.to_json()}[end_of_msg]", specials=True)
    ids += block.tolist()
    mask += [False] * len(block)
  for m in conv.messages:
    t = tok.encode(chat.render_message(m), specials=True).tolist()
    ids += t
    mask += ([False] * header + [True] * (len(t) - header)) if m.role == "assistant" else (
        [False] * len(t))
  return np.array(ids), np.array(mask)


@given(CONVS)
def test_mask_is_exactly_the_assistant_tokens(conv):
  ids, mask = sft.tokenize(conv)
  want_ids, want_mask = reference_mask(conv)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(mask, want_mask)


def test_mask_literal():
  conv = chat.Conversation((chat.Message("user", "hi"), chat.Message("assistant", "ok")))
  ids, mask = sft.tokenize(conv)
  o, s, c, e = tokenizers.CHAT_OPEN, tokenizers.CHAT_SEP, tokenizers.CHAT_CLOSE, tokenizers.CHAT_END
  b = lambda text: list(text.encode())   # noqa: E731
  want = ([tokenizers.BOS, o, *b("user"), s, *b("hi"), e, o, *b("assistant"), s]
          + [o, *b("response"), s, *b("ok"), c, e])
  assert ids.tolist() == want
  n_trained = len([o, *b("response"), s, *b("ok"), c, e])
  assert mask.tolist() == [False] * (len(want) - n_trained) + [True] * n_trained
  # A "<bos>" or "[open]"-like fragment inside a text stays bytes.
  ids2, _ = sft.tokenize(chat.Conversation((chat.Message("assistant", "<bos>[open"),)))
  assert tokenizers.BOS not in ids2[1:].tolist() and ids2.tolist().count(tokenizers.CHAT_OPEN) == 2


# ---------------------------------------------------------------------- packing
def _examples(lengths):
  """Example k: [BOS] then k+1 repeated; every other token (from 2 on) an assistant token."""
  out = []
  for k, n in enumerate(lengths):
    ids = np.array([tokenizers.BOS] + [k + 1] * (n - 1), np.int32)
    mask = (np.arange(n) % 2 == 0) & (np.arange(n) >= 2)
    out.append((ids, mask))
  return out


@given(st.lists(st.integers(2, 30), min_size=1, max_size=40), st.integers(0, 3))
def test_packing_keeps_conversations_whole(lengths, seed):
  seq_len = 20
  ex = _examples(lengths)
  p = sft.pack(ex, seq_len, seed)
  too_long = [k for k, n in enumerate(lengths) if n > seq_len + 1]
  assert p.too_long == len(too_long) and p.longest == max(lengths)
  assert p.num_conversations == len(lengths) - len(too_long)
  assert p.tokens.shape == (p.num_rows, seq_len + 2)
  seen = []
  for r in range(p.num_rows):
    tok, seg, ast = p.tokens[r], p.segment_ids[r], p.assistant[r]
    assert (tok[seq_len + 1:] == tokenizers.PAD).all()                   # the MTP column is padding
    starts = np.nonzero(tok == tokenizers.BOS)[0]
    assert starts[0] == 0
    ends = list(starts[1:]) + [int(np.sum(tok != tokenizers.PAD))]
    for j, (a, b) in enumerate(zip(starts, ends)):
      k = int(tok[a + 1]) - 1            # conversation k is [BOS] (k+1)…, at least 2 tokens
      assert b - a == lengths[k] and (tok[a + 1:b] == k + 1).all()   # whole, in one piece
      assert (seg[a:b] == j + 1).all()
      np.testing.assert_array_equal(ast[a:b], ex[k][1])
      seen.append(k)
    assert (seg[ends[-1]:] == len(starts) + 1).all() and not ast[ends[-1]:].any()
  assert sorted(seen) == sorted(set(range(len(lengths))) - set(too_long))
  assert len(seen) == len(set(seen))


def test_rows_to_batch_shifts_masks_and_targets():
  ex = _examples([7, 9])
  p = sft.pack(ex, 16, None)
  assert p.num_rows == 1 and p.fill() == 16 / 17
  b = sft.rows_to_batch(p.tokens, p.assistant, p.segment_ids)
  tok, ast = p.tokens[0], p.assistant[0]
  for t in range(16):
    assert b["inputs"][0, t] == tok[t] and b["targets"][0, t] == tok[t + 1]
    assert b["mtp_targets"][0, t] == tok[t + 2]
    assert b["loss_mask"][0, t] == float(ast[t + 1]) and b["mtp_mask"][0, t] == float(ast[t + 2])
  assert b["segment_ids"][0].tolist() == [1] * 7 + [2] * 9
  # A real conversation: loss exactly on the targets that are assistant tokens.
  conv = chat.Conversation((chat.Message("user", "q"), chat.Message("assistant", "a")))
  ids, mask = sft.tokenize(conv)
  b = sft.rows_to_batch(*(x[None] for x in (
      np.pad(ids, (0, 2), constant_values=tokenizers.PAD), np.pad(mask, (0, 2)),
      np.ones(len(ids) + 2, np.int32))))
  trained = b["targets"][0][b["loss_mask"][0] > 0]
  want = "[open]response[sep]a[close][end_of_msg]"
  assert tokenizers.ByteTokenizer().decode(trained, specials=True) == want


def test_batches_are_deterministic_epochs():
  p = sft.pack(_examples([5] * 48), 19, 0)                       # 4 per row → 12 rows
  assert p.num_rows == 12
  a, b = sft.SFTIterator(p, 4, seed=3), sft.SFTIterator(p, 4, seed=3)
  rows = [sft.batch_rows(12, 3, s, 4) for s in range(6)]
  assert sorted(np.concatenate(rows[:3]).tolist()) == list(range(12))   # one epoch, no repeat
  assert sorted(np.concatenate(rows[3:]).tolist()) == list(range(12))
  assert not np.array_equal(np.concatenate(rows[:3]), np.concatenate(rows[3:]))
  first = [next(a) for _ in range(5)]
  b.set_state(a.get_state())            # resumes at step 5
  for x, y in zip([next(a) for _ in range(2)], [next(b) for _ in range(2)]):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  np.testing.assert_array_equal(first[0]["inputs"], sft.SFTIterator(p, 4, 3).batch(0)["inputs"])
  other = sft.SFTIterator(sft.pack(_examples([5] * 44), 19, 0), 4, 3)
  with pytest.raises(ValueError, match="written for data"):
    other.set_state(a.get_state())
  with pytest.raises(ValueError, match="no conversation fits"):
    sft.SFTIterator(sft.pack(_examples([30]), 19, 0), 4)


def test_eval_batches_pad_with_empty_rows():
  p = sft.pack(_examples([5] * 20), 19, None)                    # 5 rows
  evals = sft.eval_batches(p, 9, 4)
  assert len(evals) == 2 and evals[1]["loss_mask"][1:].sum() == 0
  assert sum(float(e["loss_mask"].sum()) for e in evals) == float(p.assistant[:, 1:-1].sum())


# ---------------------------------------------------------------------- trainer
def _cfg(**over):
  c = base_config("tiny")
  c.model.num_layers = 1               # one MLA layer with a dense MLP: a quick compile
  c.train.update(dict(steps=3, batch_size=2, seq_len=96, log_every=1, eval_every=0,
                      eval_batches=1, checkpoint_every=1, progress=False, tensorboard=False,
                      peak_flops=1e11, mtp_weight=0.0))
  c.optim.muon = False                 # AdamW: a quicker compile (the data is under test)
  c.train.init = ""
  c.data.source = "sft"
  c.data.sft_file = ""
  c.data.sft_num_train = 64
  c.data.sft_num_eval = 8
  c.optim.lr = 1e-2
  for k, v in over.items():
    g, f = k.split(".")
    c[g][f] = v
  return c


def train(cfg, workdir, **kw):
  return trainer.train(run_config(cfg), workdir, **kw)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  d = tmp_path_factory.mktemp("straight")
  return d, {r["step"]: r for r in train(_cfg(), str(d))}


def test_resume_is_bit_exact(straight, tmp_path):
  _, want = straight
  first = train(_cfg(), str(tmp_path), until=2)
  second = train(_cfg(), str(tmp_path))
  assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in second] == [3]
  for r in first + second:
    assert r["loss"] == want[r["step"]]["loss"], r["step"]
    assert r["grad_norm"] == want[r["step"]]["grad_norm"]
  assert want[3]["tokens_per_s"] > 0 and np.isfinite(want[3]["loss"])


def test_init_from_checkpoint(straight, tmp_path):
  import k3jax
  from k3jax.train.state import init_variables
  from k3jax.train.trainer import init_from
  src, _ = straight
  config = run_config(_cfg()).model
  fresh = init_variables(config, jax.random.PRNGKey(7))
  variables = init_from(str(src), config, fresh)
  _, saved = k3jax.load_pretrained(src)
  jax.tree.map(np.testing.assert_array_equal, variables["params"], saved["params"])
  jax.tree.map(np.testing.assert_array_equal, variables["balance"], saved["balance"])
  with pytest.raises(ValueError, match="train.init: '/no/such' does not exist"):
    train(_cfg(**{"train.init": "/no/such"}), str(tmp_path / "x"))
  with pytest.raises(ValueError, match="num_layers"):
    init_from(str(src), run_config(_cfg(**{"model.num_layers": 3})).model, fresh)
  # End to end: a run from the checkpoint; its resume does not read train.init again.
  work = tmp_path / "ft"
  first = train(_cfg(**{"train.init": str(src)}), str(work), until=1)
  assert first[0]["loss"] < straight[1][1]["loss"]        # starts from the trained params
  more = train(_cfg(**{"train.init": str(tmp_path / "gone")}), str(work), until=2)
  assert [r["step"] for r in more] == [2]
