"""plsc.train.timers: exclusive phase times that add up to the step, off without its variable."""
import json

from plsc.train.timers import ENV, StepTimers, _TimedDist, step_timers


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_phases_are_exclusive_and_add_up():
    clock = Clock()
    t = StepTimers(0, 2, 64, clock=clock)
    t.enter("data")
    clock.t = 1.0
    t.leave()  # data 1
    t.enter("backbone")
    clock.t = 3.0
    t.switch("backbone", "head")  # backbone 2
    t.enter("collectives")
    clock.t = 3.5
    t.leave()  # collectives 0.5
    clock.t = 4.0
    t.switch("head", "backbone")  # head 0.5
    t.switch("head", "optimizer")  # not on top: ignored
    clock.t = 6.0
    t.leave()  # backbone 2 more
    t.enter("checkpoint_eval")
    clock.t = 9.0
    t.leave()  # left out of the step
    clock.t = 9.5
    t.end_step(1)  # checks_logging 0.5
    (s,) = t.steps
    assert s["wall_s"] == 6.5 and s["checkpoint_eval_s"] == 3.0
    assert (s["data"], s["backbone"], s["head"], s["collectives"]) == (1.0, 4.0, 0.5, 0.5)
    assert s["checks_logging"] == 0.5 and s["optimizer"] == 0.0
    phases = ("data", "backbone", "head", "collectives", "optimizer", "checks_logging")
    assert sum(s[p] for p in phases) == s["wall_s"]
    t.enter("data")  # the next step starts where the last ended
    clock.t = 10.0
    t.leave()
    t.end_step(2)
    assert t.steps[1]["wall_s"] == 0.5 and t.steps[1]["data"] == 0.5


def test_timed_dist_counts_calls_and_waits():
    clock = Clock()
    t = StepTimers(0, 2, 8, clock=clock)

    class Task:
        def wait(self):
            clock.t += 2.0

    class Dist:
        ReduceOp = "ops"

        def all_reduce(self, x, sync_op=True):
            clock.t += 1.0
            return Task() if not sync_op else None

    d = _TimedDist(Dist(), t)
    assert d.ReduceOp == "ops"
    t.enter("backbone")
    d.all_reduce(1)
    d.all_reduce(1, sync_op=False).wait()
    t.leave()
    t.end_step(1)
    assert t.steps[0]["collectives"] == 4.0 and t.steps[0]["backbone"] == 0.0


def test_collectives_of_another_thread_are_not_a_phase():
    """The gradient sum's communication thread calls the collectives too: its time is not
    the main thread's (it is in the step record's grad_sum_* values instead)."""
    import threading
    clock = Clock()
    t = StepTimers(0, 2, 8, clock=clock)
    calls = []

    class Dist:
        def all_reduce(self, x, sync_op=True):
            clock.t += 1.0
            calls.append(x)

    d = _TimedDist(Dist(), t)
    t.enter("backbone")
    worker = threading.Thread(target=d.all_reduce, args=(7,))
    worker.start()
    worker.join()
    t.leave()
    t.end_step(1, {"grad_sum_hidden_s": 0.5})
    assert calls == [7] and t.steps[0]["collectives"] == 0.0 and t.steps[0]["backbone"] == 1.0
    assert t.steps[0]["grad_sum_hidden_s"] == 0.5


def test_off_without_the_variable(tmp_path):
    class Trainer:
        rank, world, global_batch = 0, 1, 8

    with step_timers(Trainer(), environ={}) as timers:
        assert timers is None


def test_report_written(tmp_path, monkeypatch):
    import plsc.train.timers as timers_mod
    monkeypatch.setattr(timers_mod, "_install", lambda trainer, timers: [])

    class Trainer:
        rank, world, global_batch = 1, 2, 8

    prefix = str(tmp_path / "steps")
    with step_timers(Trainer(), environ={ENV: prefix}) as timers:
        assert timers is not None
    with open(prefix + ".rank1.json") as f:
        report = json.load(f)
    assert report["rank"] == 1 and report["steps"] == [] and report["vm_hwm_bytes"] > 0


def test_trainer_steps_timed_and_unchanged(tmp_path, monkeypatch):
    """A run with PLSC_STEP_TIMES takes the same steps as one without; every step is split
    into phases that add up to its wall time; the trainer is left unwrapped."""
    from trainer_common import config, make_data
    from plsc.train import Trainer
    data_root = make_data(str(tmp_path / "data"))
    sections = dict(Global={"max_steps": 4}, Checkpoint={"interval": 2})
    plain = Trainer(config(data_root, str(tmp_path / "a"), **sections)).train()
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    trainer = Trainer(config(data_root, str(tmp_path / "b"), **sections))
    assert trainer.train() == plain
    assert not {"_fetch", "optimizer_step", "save"} & set(vars(trainer))
    with open(tmp_path / "steps.rank0.json") as f:
        report = json.load(f)
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert abs(sum(s[p] for p in report["phases"]) - s["wall_s"]) < 1e-6
        assert s["backbone"] > 0 and s["head"] > 0 and s["optimizer"] > 0 and s["data"] > 0
        assert s["grad_sum_ran_s"] == s["grad_sum_buckets_in_backward"] == 0  # one rank
    assert steps[1]["checkpoint_eval_s"] > 0 and steps[2]["checkpoint_eval_s"] == 0
