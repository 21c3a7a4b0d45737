"""The kernel sets plsc runs its element-wise and row-wise work on: numpy on Paddle's CPU tensors
(`cpu_kernels`, which also picks the set: the CPU set, or Paddle's own ops on a GPU or under
``PLSC_KERNELS=device``; the sets' names and `PLSC_KERNELS`' reading, without Paddle, are
`names`), the oneDNN library Paddle's CPU wheel bundles (`onednn`), and the numerics both share
(`numerics`: the float32 upcast, round-to-nearest casts, an exact sqrt, slab budgets)."""
