"""A visual task that needs a tool (K3 §13's vision-in-the-loop RL at CPU scale): read a small
shape in a large image through a `crop` tool.

The image is `SIZE`×`SIZE` px (224 = 4× the 56 px images of the shapes corpus,
k3jax/data/captions.py), a `GRID`×`GRID` grid of `CELL`-px cells named A1 … D4 (rows A–D from
the top, columns 1–4 from the left). Four small shapes (half-size 5–9 px, as a 56 px
caption image's), one of each colour of `captions.COLOURS`, lie in four distinct cells, each
inside its cell with a margin. The question names one of those cells: "What colour is the
shape in cell B3?"; the answer is its colour (one word, checked exactly by `is_correct`, the
hidden verifier). The policy sees the image only downscaled to `OVERVIEW` px (a box average
of 4×4 pixels: each cell becomes 14×14 px, one patch of the tower, and a shape a blob of 2–4
px), so reading the colour of the right cell from it means locating the cell in a 2×2 grid of
merged vision tokens; the `crop` tool returns the named cell at full resolution (56 px, one
shape as large as in the caption corpus).

Prompt (thinking mode, no BOS), M = the media placeholder, 4 per 56 px image (2×2 merged):
  [open]options[sep]{"effort":…,"tools":[crop]}[end_of_msg]
  [open]user[sep]M M M M What colour is the shape in cell B3?[end_of_msg]
  [open]assistant[sep][open]think[sep]
A tool call: `[{"arguments":{"cell":"B3"},"name":"crop"}]`; the environment
(k3jax/posttrain/rl/env.py, `ToolEnv(tools=("crop",))`) answers with a tool message holding
the crop as a media block: `[open]tool[sep]M M M M cell B3[end_of_msg]`. `demonstration`
is the conversation a good policy produces (the cold start's SFT data), `images` its media.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.data import captions, chat
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.rl_tasks import TaskSampler
from k3jax.data.tokenizers import MEDIA, ByteTokenizer
from k3jax.data.tool_tasks import extract_answer

DOMAINS = ("crop",)
EFFORTS = chat.EFFORTS
GRID, CELL = 4, 56
SIZE = GRID * CELL
OVERVIEW = 56
ROWS, COLS = "ABCD", "1234"
MERGED = 4                    # merged vision tokens of a 56 px image (14 px patches, 2×2 merge)
CROP_TOOL = chat.ToolSpec(
    name="crop", description="Zoom into one cell (A1-D4).",
    parameters={"properties": {"cell": {"type": "string"}}})
WITHHELD = "error: the crop tool is unavailable"
_ENCODER = ChatEncoder(ByteTokenizer(), media_id=MEDIA)


@dataclasses.dataclass(frozen=True, eq=False)
class VisualTask:
  """One task. `conversation` / `tokens` / `images` (the overview, for the user message's
  placeholders) are what the policy sees; `answer`, `spec` and `image` (the full image, read
  only by the crop tool) belong to the environment and the verifier."""
  uid: int
  domain: str
  effort: str
  question: str
  answer: str
  cell: str
  spec: tuple                 # ((cell, colour, shape), …) of the four shapes
  image: np.ndarray           # [SIZE, SIZE, 3] uint8
  images: tuple               # (overview [OVERVIEW, OVERVIEW, 3] uint8,)
  conversation: chat.Conversation
  tokens: tuple[int, ...]


def cell_name(row: int, col: int) -> str:
  return f"{ROWS[row]}{COLS[col]}"


def parse_cell(cell) -> tuple[int, int]:
  """"B3" → (1, 2); ValueError naming the value for anything else."""
  if not (isinstance(cell, str) and len(cell) == 2 and cell[0].upper() in ROWS
          and cell[1] in COLS):
    raise ValueError(f"cell: expected a row {ROWS[0]}-{ROWS[-1]} and a column "
                     f"{COLS[0]}-{COLS[-1]} such as 'B3', found {cell!r}")
  return ROWS.index(cell[0].upper()), COLS.index(cell[1])


def crop(image: np.ndarray, cell: str) -> np.ndarray:
  """The cell of a `SIZE`-px task image, [CELL, CELL, 3] (a copy)."""
  r, c = parse_cell(cell)
  size = image.shape[0] // GRID
  return np.array(image[r * size:(r + 1) * size, c * size:(c + 1) * size])


def downscale(image: np.ndarray, size: int = OVERVIEW) -> np.ndarray:
  """Box average to `size` px (the image's side a multiple of it), uint8."""
  f = image.shape[0] // size
  if image.shape[0] != size * f or image.shape[1] != size * f:
    raise ValueError(f"image: expected a square side multiple of {size}, found {image.shape}")
  x = image.astype(np.float32).reshape(size, f, size, f, 3).mean(axis=(1, 3))
  return np.clip(np.round(x), 0, 255).astype(np.uint8)


def render(rng: np.random.Generator) -> tuple[np.ndarray, tuple]:
  """(image [SIZE, SIZE, 3] uint8, ((cell, colour, shape), …)): four shapes of four colours
  in four distinct cells."""
  img = captions._canvas(rng, SIZE)
  cells = rng.permutation(GRID * GRID)[:len(captions.COLOURS)]
  spec = []
  for k, colour in zip(cells.tolist(), rng.permutation(list(captions.COLOURS)).tolist()):
    r, c = divmod(k, GRID)
    shape = captions.SHAPES[int(rng.integers(len(captions.SHAPES)))]
    rad = float(rng.uniform(5, 9))
    cx = c * CELL + rng.uniform(rad + 2, CELL - rad - 2)
    cy = r * CELL + rng.uniform(rad + 2, CELL - rad - 2)
    rgb = np.clip(np.asarray(captions.COLOURS[colour]) + rng.integers(-12, 13, size=3), 0, 255)
    captions._paint(img, captions._mask(shape, SIZE, cx, cy, rad), rgb)
    spec.append((cell_name(r, c), colour, shape))
  return img.astype(np.uint8), tuple(spec)


def conversation(question: str, effort: str) -> chat.Conversation:
  """Global options (the effort and the crop tool), then the user's question."""
  return chat.user_conversation(question, options=chat.Options((CROP_TOOL,), effort))


def make_task(rng: np.random.Generator, uid: int, domain: str = "crop",
              effort: str = "high") -> VisualTask:
  if domain not in DOMAINS:
    raise ValueError(f"domain: expected one of {DOMAINS}, found {domain!r}")
  if effort not in EFFORTS:
    raise ValueError(f"effort: expected one of {EFFORTS}, found {effort!r}")
  image, spec = render(rng)
  cell, colour, _ = spec[int(rng.integers(len(spec)))]
  q = f"What colour is the shape in cell {cell}?"
  conv = conversation(q, effort)
  ids = _ENCODER.encode(conv, reply="thinking", bos=False, media={0: [MERGED]}).ids
  return VisualTask(uid, domain, effort, q, colour, cell, spec, image, (downscale(image),),
                    conv, tuple(int(i) for i in ids))


def is_correct(task: VisualTask, response: str | None) -> bool:
  """The hidden verifier: the final answer's last word is the colour."""
  return extract_answer(response) == task.answer


def tool_text(cell: str) -> str:
  """The text of the crop tool's message (after its image)."""
  return f"cell {cell}"


def demonstration(task: VisualTask, withheld: bool = False
                  ) -> tuple[chat.Conversation, dict[int, tuple]]:
  """(conversation, images by message index): the crop call on the question's cell, the
  tool's message with the crop, the answer — what the environment and a good policy produce.
  `withheld`: the tool answers with `WITHHELD` (no image) and the answer follows anyway."""
  call = chat.ToolCall("crop", {"cell": task.cell})
  tool = chat.Message("tool", WITHHELD if withheld else tool_text(task.cell))
  msgs = tuple(task.conversation.messages) + (
      chat.Message("assistant", None, "", (call,)), tool,
      chat.Message("assistant", task.answer, ""))
  images = {0: task.images}
  if not withheld:
    images[2] = (crop(task.image, task.cell),)
  return chat.Conversation(msgs, task.conversation.options), images


class VisualTaskSampler(TaskSampler):
  """Draws visual tasks over `domains` × `efforts`, reproducibly from `seed`."""
  known = DOMAINS
  make = staticmethod(make_task)


__all__ = ["DOMAINS", "GRID", "CELL", "SIZE", "OVERVIEW", "MERGED", "CROP_TOOL", "WITHHELD",
           "VisualTask", "VisualTaskSampler", "make_task", "is_correct", "crop", "downscale",
           "parse_cell", "cell_name", "demonstration", "tool_text", "render", "conversation"]
