"""Datasets and file formats for face-recognition training."""
