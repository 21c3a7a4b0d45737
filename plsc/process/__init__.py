"""How a tool's process starts and ends: stop signals from its first line (`startup`), the
device and process group a run begins with and what must happen before Paddle loads
(`runtime`), the CPU's threads and malloc (`cpu_setup`), progress bars (`progress`) and every
exit status (`exits`). The command line the tools share is `plsc.cli`, one floor up: it turns
the data's and the checkpoints' errors into these statuses."""
