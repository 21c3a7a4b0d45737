"""Every tool in tools/, every kind of mistake that applies to it: a missing path, a file of the
wrong kind (an image, a .npy, a .rec, a YAML, a .pt), an empty folder, an impossible number, an
output that cannot be written. Each ends with a status from docs/faults.md's table (parsed from
the page, so the page and this test agree), exactly one `error:` line naming the argument or
file, and no traceback. A tool in tools/ without a row here fails the test. Most rows run in
this process (the tool's `main`); those marked `proc` run as real processes, the only proof
that nothing before `main`'s guards raises. `Entry`'s public methods have their own rows: a
mistake is one exception whose message names the argument or file."""
import glob
import os
import re
import signal
import subprocess
import sys
import traceback
import zipfile

import numpy as np
import pytest
import yaml

import scripts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = 16


def statuses_of_the_faults_page():
    """The exit statuses docs/faults.md's first table lists (its `| N ... | meaning |` rows)."""
    with open(os.path.join(ROOT, "docs", "faults.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("| exit status | meaning |", 1)[1].split("\n\n", 1)[0]
    return {int(m.group(1)) for m in re.finditer(r"^\| (\d+)\b", table, re.M)}


FAULT_STATUSES = statuses_of_the_faults_page()
ERROR_LINE = re.compile(r"^(?:[\w.]+(?: [\w-]+)?: )?error: ")  # ours, or argparse's `prog [command]: error:`


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs of every kind: good ones (a config, its weights, a synthetic .rec set, an image
    folder) and the wrong ones the rows give by mistake."""
    import cv2
    import paddle
    from plsc.config import validate
    from plsc.data.synthetic import generate
    from plsc.parts import build_backbone
    tmp = tmp_path_factory.mktemp("mistakes")
    data = str(tmp / "data")
    generate(data, image_size=IMAGE, num_identities=4, images_per_identity=2, num_val_identities=2,
             num_pairs=4)
    rng = np.random.default_rng(0)
    jpg = str(tmp / "face.jpg")
    cv2.imwrite(jpg, rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8))
    os.makedirs(tmp / "faces" / "p0")
    cv2.imwrite(str(tmp / "faces" / "p0" / "a.png"), rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8))
    np.save(tmp / "x.npy", rng.normal(size=(4, 8)).astype(np.float32))
    np.save(tmp / "x_labels.npy", np.arange(4) // 2)
    with zipfile.ZipFile(tmp / "w.pt", "w") as z:  # what torch.save writes: a zip archive
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    (tmp / "pairs.txt").write_text(f"{jpg} {jpg} 1\n")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    os.makedirs(tmp / "empty")
    jpeg = open(jpg, "rb").read()
    # an image where a .rec, a property file or a verification pack belongs
    for folder, files_ in (("badrec", {"train.rec": jpeg, "train.idx": b"0\t0\n1\t100\n",
                                       "property": b"4,16,16\n"}),
                           ("badprop", {"property": jpeg, **{name: open(os.path.join(data, name), "rb").read()
                                                             for name in ("train.rec", "train.idx")}}),
                           ("badbin", {"val.bin": jpeg})):
        os.makedirs(tmp / folder)
        for name, content in files_.items():
            (tmp / folder / name).write_bytes(content)
    raw = {"Global": {"seed": 0, "output_dir": str(tmp / "run"), "device": "cpu", "checkpoint": None},
           "Model": {"name": "IResNetTiny", "embedding_size": 16},
           "Loss": {"margin": "cosface", "scale": 16.0, "m3": 0.2, "num_classes": 4},
           "Data": {"dataset": "recordio", "root": data, "image_size": [IMAGE, IMAGE], "batch_size": 4,
                    "num_workers": 0},
           "Eval": {"root": data, "targets": ["val"], "batch_size": 4},
           "Logging": {"visualdl": False, "progress_bar": False}}
    cfg = str(tmp / "config.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump(raw, f)
    weights = str(tmp / "backbone.pdparams")
    paddle.save(build_backbone(validate(raw)).state_dict(), weights)
    return {"tmp": str(tmp), "cfg": cfg, "w": weights, "data": data, "rec": os.path.join(data, "train.rec"),
            "jpg": jpg, "npy": str(tmp / "x.npy"), "pt": str(tmp / "w.pt"), "faces": str(tmp / "faces"),
            "pairs": str(tmp / "pairs.txt"), "listyaml": str(tmp / "list.yaml"),
            "empty": str(tmp / "empty"), "missing": str(tmp / "missing"), "ro": str(tmp / "ro"),
            **{name: str(tmp / name) for name in ("badrec", "badprop", "badbin")},
            "out": str(tmp / "out")}


W = "-o Global.pretrained={w}"  # the tools that embed: a backbone's weights
# (tool, command line, status, a word its error line must contain, options: proc = a real
# process, ro = {ro} is read-only (the atomic writer's test hook)).
ROWS = [
    ("checkpoint", "verify {missing}", 2, "missing", ""),
    ("checkpoint", "verify {empty}", 2, "empty", ""),
    ("checkpoint", "verify {jpg}", 2, "face.jpg", ""),
    ("checkpoint", "verify {data} --level x", 2, "--level", ""),
    ("checkpoint", "import-arcface-torch {missing} -c {cfg}", 2, "missing", ""),
    ("checkpoint", "import-arcface-torch {empty} -c {jpg}", 2, "face.jpg", ""),
    ("clean_subcenters", "-c {cfg} --threshold 0", 2, "threshold", ""),
    ("clean_subcenters", "-c {cfg} --threshold 180", 2, "threshold", ""),
    ("clean_subcenters", "-c {npy}", 2, "x.npy", ""),
    ("clean_subcenters", "-c {cfg} --checkpoint {missing}", 2, "missing", ""),
    ("convert_weights", "--to-plsc {missing} --model r50 --output {out}.pdparams", 2, "missing", "proc"),
    ("convert_weights", "--to-plsc {jpg} --model r50 --output {out}.pdparams", 2, "face.jpg", ""),
    ("convert_weights", "--to-plsc {pt} --model r50 --output {out}.pdparams", 2, "w.pt", ""),
    ("convert_weights", "--to-insightface {npy} --model r50 --output {out}.pt", 65, "x.npy", ""),
    ("convert_weights", "--to-insightface {empty} --output {out}.pt", 2, "empty", ""),
    ("convert_weights", "--to-plsc {pt} --model r50 --input-size 0 --output {out}", 2, "--input-size", ""),
    ("convert_weights", "--to-insightface {w} --model IResNetTiny --input-size 16 --output {ro}/b.pt",
     74, "ro", "ro"),
    ("eval", "-c {jpg}", 2, "face.jpg", "proc"),
    ("eval", "-c {missing}", 2, "missing", ""),
    ("eval", "-c {listyaml}", 2, "list.yaml", ""),
    ("eval", "-c {cfg} -o Global.pretrained={missing}", 2, "missing", ""),
    ("eval", "-c {cfg} -o Global.pretrained={jpg}", 65, "face.jpg", ""),
    ("eval", "-c {cfg} -o Global.checkpoint={empty}", 2, "empty", ""),
    ("eval", "-c {cfg} " + W + " -o Eval.root={empty}", 2, "val", ""),
    ("eval", "-c {cfg} " + W + " -o Eval.root={badbin}", 65, "val.bin", ""),
    ("eval_allpairs", "-c {cfg} --embeddings {missing}", 2, "missing", ""),
    ("eval_allpairs", "-c {cfg} --embeddings {jpg}", 65, "face.jpg", ""),
    ("eval_allpairs", "-c {cfg} --embeddings {npy} --far 2", 2, "--far", ""),
    ("eval_allpairs", "-c {cfg} --embeddings {npy} --block-mb 0", 2, "--block-mb", ""),
    ("eval_ijb", "-c {cfg} --root {missing} --target IJBC", 2, "missing", ""),
    ("eval_ijb", "-c {cfg} --root {empty} --target IJBC", 2, "empty", ""),
    ("eval_ijb", "-c {cfg} --root {jpg} --target IJBC", 2, "face.jpg", ""),
    ("eval_ijb", "-c {cfg} --root {data} --target IJBX", 2, "--target", ""),
    ("eval_megaface", "-c {cfg} --probes {missing} --distractors {npy}", 2, "missing", ""),
    ("eval_megaface", "-c {cfg} " + W + " --probes {npy} --distractors {jpg}", 65, "face.jpg", ""),
    ("eval_megaface", "-c {cfg} --probes {npy} --distractors {npy} --count 0", 2, "--count", ""),
    ("eval_megaface", "-c {cfg} --probes {npy} --distractors {npy} --far 0", 2, "--far", ""),
    ("export", "-c {jpg}", 2, "face.jpg", ""),
    ("export", "-c {cfg} -o Global.pretrained={npy}", 65, "x.npy", ""),
    ("export", "-c {cfg} -o Global.pretrained={missing}", 2, "missing", ""),
    ("export", "-c {cfg} " + W + " --no-onnx --output {ro}/export", 74, "ro", "ro"),
    ("extract", "-c {cfg} " + W + " --input {jpg} --output {out}.npy", 65, "face.jpg", "proc"),
    ("extract", "-c {cfg} " + W + " --input {missing} --output {out}.npy", 2, "missing", ""),
    ("extract", "-c {cfg} " + W + " --input {empty} --output {out}.npy", 65, "empty", ""),
    ("extract", "-c {cfg} " + W + " --input {badrec} --output {out}.npy", 65, "train.rec", ""),
    ("extract", "-c {cfg} " + W + " --input {badprop} --output {out}.npy", 65, "property", ""),
    ("extract", "-c {cfg} " + W + " --input {faces} --output {out}.npy --batch-size 0", 2, "--batch-size",
     ""),
    ("extract", "-c {cfg} " + W + " --input {faces} --output {ro}/e.npy", 74, "ro", "ro"),
    ("make_synthetic", "--output {out} --image-size -5", 2, "--image-size", "proc"),
    ("make_synthetic", "--output {out} --identities 0", 2, "--identities", ""),
    ("make_synthetic", "--output {out} --pairs 1", 2, "--pairs", ""),
    ("make_synthetic", "--output {out} --strength nan", 2, "--strength", ""),
    ("make_synthetic", "--output {ro} --identities 2 --val-identities 2 --pairs 2 --image-size 8",
     74, "ro", "ro"),
    ("make_verification_bin", "--pairs {missing} --output {out}.bin", 2, "missing", ""),
    ("make_verification_bin", "--pairs {jpg} --output {out}.bin", 65, "face.jpg", ""),
    ("make_verification_bin", "--pairs {pairs} --output {out}.bin --landmarks {npy}", 65, "x.npy", ""),
    ("make_verification_bin", "--pairs {pairs} --output {out}.bin --image-size 0", 2, "--image-size", ""),
    ("make_verification_bin", "--pairs {pairs} --output {out}.bin --quality 101", 2, "--quality", ""),
    ("make_verification_bin", "--pairs {pairs} --output {ro}/val.bin", 74, "ro", "ro"),
    ("pack_rec", "--input {missing} --output {out}", 2, "missing", "proc"),
    ("pack_rec", "--input {jpg} --output {out}", 65, "face.jpg", "proc"),
    ("pack_rec", "--input {rec} --output {out}", 65, "train.rec", ""),
    ("pack_rec", "--input {empty} --output {out}", 65, "empty", ""),
    ("pack_rec", "--landmarks {npy} --output {out}", 65, "x.npy", ""),
    ("pack_rec", "--landmarks {missing} --output {out}", 2, "missing", ""),
    ("pack_rec", "--input {faces} --output {out} --image-size -5", 2, "--image-size", ""),
    ("pack_rec", "--input {faces} --output {out} --workers 0", 2, "--workers", ""),
    ("pack_rec", "--input {faces} --output {ro}", 74, "ro", "ro"),
    ("pack_rec", "--input {faces} --output {jpg}", 2, "face.jpg", ""),
    ("plan", "-c {jpg}", 2, "face.jpg", ""),
    ("plan", "-c {cfg} --ranks 0", 2, "--ranks", ""),
    ("reshard", "{missing} --world-size 2 --output {out}", 2, "missing", ""),
    ("reshard", "{empty} --world-size 2 --output {out}", 2, "empty", ""),
    ("reshard", "{jpg} --export {out}.npy", 2, "face.jpg", ""),
    ("reshard", "{data} --world-size 0 --output {out}", 2, "--world-size", ""),
    ("search", "-c {cfg} build --embeddings {missing} --index {out}.npz", 2, "missing", ""),
    ("search", "-c {cfg} build --embeddings {jpg} --index {out}.npz", 65, "face.jpg", ""),
    ("search", "-c {cfg} build --embeddings {npy} --index {ro}/i.npz", 74, "ro", "ro"),
    ("search", "-c {cfg} build --embeddings {npy} --index {jpg}/i.npz", 2, "face.jpg/i.npz", ""),
    ("search", "-c {cfg} build --embeddings {npy} --index {out}.npz --nprobe 0", 2, "--nprobe", ""),
    ("search", "-c {cfg} query --index {npy} --queries {npy} --output {out}.npz", 65, "x.npy", ""),
    ("search", "-c {cfg} query --index {missing} --queries {npy} --output {out}.npz", 2, "missing", ""),
    ("search", "-c {cfg} query --index {npy} --queries {npy} --output {out}.npz -k 0", 2, "-k", ""),
    ("search", "-c {cfg} threshold --index {npy} --nonmated {npy} --fpir 1.5", 2, "--fpir", ""),
    ("train", "-c {jpg}", 2, "face.jpg", "proc"),
    ("train", "-c {npy}", 2, "x.npy", ""),
    ("train", "-c {pt}", 2, "w.pt", ""),
    ("train", "-c {missing}", 2, "missing", ""),
    ("train", "-c {empty}", 2, "empty", ""),
    ("train", "-c {listyaml}", 2, "list.yaml", ""),
    ("train", "-c {cfg} -o Data.root={missing}", 2, "missing", ""),
    ("train", "-c {cfg} -o Data.root={badprop}", 65, "property", ""),
    ("train", "-c {cfg} -o Global.output_dir={ro}", 74, "ro", "ro"),
]


def run_in_process(tool, argv, capfd):
    """(status, stdout + stderr) of tools/<tool>.py's main(argv) in this process; an exception
    that escapes main is printed as the traceback a real process would show. The stop signals'
    handlers main installs are put back afterwards."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = scripts.load(f"tools/{tool}.py").main(argv)
    except SystemExit as stop:  # argparse
        status = stop.code
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    out = capfd.readouterr()
    return status, out.out + out.err


def run_process(tool, argv, env):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", f"{tool}.py")] + argv,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))
    return proc.returncode, proc.stdout + proc.stderr


def test_every_tool_has_rows():
    tools = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "tools", "*.py"))}
    missing = tools - {row[0] for row in ROWS}
    assert not missing, f"tools without rows in the mistakes table: {sorted(missing)}"


@pytest.mark.parametrize("tool,line,status,word,options", ROWS,
                         ids=[f"{r[0]}:{r[1][:60]}" for r in ROWS])
def test_a_mistake_is_one_line_and_a_documented_status(files, tool, line, status, word, options,
                                                       capfd, monkeypatch, tmp_path):
    assert status in FAULT_STATUSES and status != 0
    paths = dict(files, out=str(tmp_path / "out"), ro=str(tmp_path / "ro"))
    argv = [arg.format(**paths) for arg in line.split()]
    env = {}
    if "ro" in options.split():
        os.makedirs(paths["ro"])
        env["PLSC_TEST_READ_ONLY"] = paths["ro"]
        monkeypatch.setenv("PLSC_TEST_READ_ONLY", paths["ro"])
    if "proc" in options.split():
        got, text = run_process(tool, argv, env)
    else:
        got, text = run_in_process(tool, argv, capfd)
    errors = [ln for ln in text.splitlines() if ERROR_LINE.match(ln)]
    assert "Traceback" not in text, text
    assert got == status and len(errors) == 1 and word in errors[0], (got, text)


def entry(f, **globals_):
    """An Entry over the fixture's config (its weights as Global.pretrained)."""
    from plsc import Entry
    with open(f["cfg"], encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["Global"].update({"pretrained": f["w"]}, **globals_)
    return Entry(raw)


# (what, the call on the fixture's files `f` and a scratch folder `t`, the exception, a word its
# message must contain). Entry's setters raise ValueError naming their argument.
ENTRY_ROWS = [
    ("set_class_num(0)", lambda f, t: entry(f).set_class_num(0), ValueError, "class_num"),
    ("set_image_size(-5)", lambda f, t: entry(f).set_image_size(-5), ValueError, "image_size"),
    ("set_train_batch_size(0)", lambda f, t: entry(f).set_train_batch_size(0), ValueError,
     "train_batch_size"),
    ("set_sample_ratio(1.5)", lambda f, t: entry(f).set_sample_ratio(1.5), ValueError, "sample_ratio"),
    ("set_lr(-1)", lambda f, t: entry(f).set_lr(-1), ValueError, "lr"),
    ("set_model_name(IResNet51)", lambda f, t: entry(f).set_model_name("IResNet51"), ValueError,
     "IResNet50"),
    ("set_checkpoint_dir(missing)", lambda f, t: entry(f).set_checkpoint_dir(f["missing"]), ValueError,
     "checkpoint_dir"),
    ("from_config(jpg)", lambda f, t: type(entry(f)).from_config(f["jpg"]), "ConfigError", "face.jpg"),
    ("from_config(missing)", lambda f, t: type(entry(f)).from_config(f["missing"]), "ConfigError", "missing"),
    ("train(): dataset_dir missing", lambda f, t: entry(f).set_dataset_dir(f["missing"]).train(),
     "ConfigError", "missing"),
    ("train(): dataset_dir empty", lambda f, t: entry(f).set_dataset_dir(f["empty"]).train(),
     "ConfigError", "empty"),
    ("train(): output read-only", lambda f, t: entry(f).set_model_save_dir(t["ro"]).train(),
     "FolderNotWritable", "ro"),
    ("test(): no checkpoint", lambda f, t: entry(f, pretrained=None, checkpoint="latest").test(),
     FileNotFoundError, "checkpoint"),
    ("convert_for_prediction(read-only)",
     lambda f, t: entry(f).convert_for_prediction(os.path.join(t["ro"], "export"), onnx=False),
     OSError, "ro"),
    ("predict(missing image)", lambda f, t: entry(f).predict([f["missing"]]), FileNotFoundError, "missing"),
    ("predict(a .npy)", lambda f, t: entry(f).predict([f["npy"]]), "DataError", "x.npy"),
]


@pytest.mark.parametrize("what,call,kind,word", ENTRY_ROWS, ids=[r[0] for r in ENTRY_ROWS])
def test_an_entry_mistake_is_one_exception_naming_it(files, what, call, kind, word, monkeypatch, tmp_path):
    from plsc.checkpoint.lock import FolderNotWritable
    from plsc.config import ConfigError
    from plsc.data import DataError
    kind = {"ConfigError": ConfigError, "DataError": DataError,
            "FolderNotWritable": FolderNotWritable}.get(kind, kind)
    scratch = {"ro": str(tmp_path / "ro")}
    os.makedirs(scratch["ro"])
    monkeypatch.setenv("PLSC_TEST_READ_ONLY", scratch["ro"])
    with pytest.raises(kind) as caught:
        call(files, scratch)
    message = str(caught.value)
    assert word in message and "\n" not in message.strip(), message
