"""`tiny_multimodal`: `tiny` + a 2-layer MoonViT-V2 tower, trained from scratch with the language
model on the procedurally generated shapes corpus (k3jax/data/captions.py): images and clips of
coloured shapes with captions only the pixels predict (`make train-vision`, a CPU run of a few
minutes, then experiments/eval_vision.py: caption loss with the true images vs shuffled ones).

python -m experiments.train --config=configs/tiny_multimodal.py --workdir=runs/vision

data.source="shapes"; data.text_fraction of the rows are text windows of data.text_source
(interleaved, empty media); data.media_length: patches per row's media stream (one of the tower's
pack_buckets; 0 = the largest), fixed per run so the step compiles once.
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("tiny_multimodal")
  c.model.num_layers = 5          # prefix layer + one scanned [KDA×3, MLA] group: minutes on a CPU
  c.train.steps = 600
  c.train.batch_size = 8
  c.train.seq_len = 128
  c.train.checkpoint_every = 200
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.train.log_every = 10
  c.optim.lr = 3e-3
  c.data.source = "shapes"
  c.data.text_fraction = 0.0
  c.data.text_source = "stdlib"
  c.data.media_length = 128
  return c
