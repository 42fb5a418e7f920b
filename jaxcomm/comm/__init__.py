"""The communication layer: buckets, error-feedback state, the compressed collectives.

``buckets`` (the bucket plan, the concatenated and rank-major layouts, ``map_buckets``) sits
below the compressors, which lay out their buffers with it; ``state`` (state types, checks, the
non-finite guard, the per-device registry), ``reduce`` (the bucket reduction), ``all_reduce``,
``scatter_gather``, ``hierarchical`` and ``backend`` (``CommBackend``) sit above them. This
``__init__`` imports none of them (the compressors import ``buckets``, and the collectives
import the compressors); the public names are ``jc.*``.
"""
