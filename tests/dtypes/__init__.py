"""Dtype behaviour in one place: 16- and 8-bit storage of the head, its rounding, the optimizers,
checkpoints and the trainer on narrow centres, and AMP."""
