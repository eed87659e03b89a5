"""Deprecated location of `eventkv.models.cache_dir` (the on-disk model cache), kept for one release.

Import ``eventkv.models.cache_dir`` instead. This module only re-exports its public names; patching
an attribute here does not change what `eventkv.models` uses.
"""

from eventkv.models.cache_dir import (
    CACHE_ENV,
    FULL_VERIFY_ENV,
    MANIFEST_FORMAT,
    MODEL_MANIFEST,
    STAMP_NAME,
    CacheCheck,
    cache_root,
    check_dir,
    dir_files,
    dir_size,
    hash_files,
    model_dir,
    read_manifest,
    sha256_file,
    write_manifest,
)

__all__ = [
    "CACHE_ENV",
    "FULL_VERIFY_ENV",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MODEL_MANIFEST",
    "STAMP_NAME",
    "CacheCheck",
    "cache_root",
    "check_dir",
    "dir_files",
    "dir_size",
    "hash_files",
    "model_dir",
    "read_manifest",
    "sha256_file",
    "write_manifest",
]

MANIFEST_NAME = MODEL_MANIFEST  # this module's name for the model manifest file
