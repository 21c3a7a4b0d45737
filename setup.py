"""plsc: PaddlePaddle large-scale classification (model-parallel softmax, Partial FC)."""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(HERE, "plsc", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _readme():
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


setup(
    name="plsc",
    version=_version(),
    description="Model-parallel softmax and Partial FC for million-class training in PaddlePaddle",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["plsc", "plsc.*"]),
    package_data={"plsc.train.plan": ["measured_table.json"]},  # the planner's measured table
    python_requires=">=3.8",
    # Paddle is not a hard requirement: CPU users take the `cpu` extra,
    # GPU users install the paddlepaddle-gpu wheel that matches their CUDA.
    install_requires=[
        "numpy>=1.21",
        "pyyaml>=5.4",
        "opencv-python>=4.5",
        "visualdl>=2.5",
    ],
    extras_require={
        "cpu": ["paddlepaddle>=3.0"],
        "onnx": ["paddle2onnx>=2.0", "onnxruntime>=1.16"],
        # paddle.distributed.launch --master etcd://... (automatic restart) imports etcd3
        "elastic": ["etcd3>=0.12"],
        # tools/search.py --kind ivf|hnsw (plsc.search)
        "search": ["faiss-cpu>=1.7"],
        # the documentation site and its API reference: mkdocs build --strict (mkdocs.yml)
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26,<2"],
        "test": ["pytest>=7", "paddle2onnx>=2.0", "onnxruntime>=1.16", "etcd3>=0.12",
                 "scikit-learn>=1.0",  # the ROC oracle of the IJB tests
                 "faiss-cpu>=1.7",  # plsc.search's IVF / HNSW recall tests
                 "coverage>=7"],  # the device kernel set's coverage (docs/head.md)
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
