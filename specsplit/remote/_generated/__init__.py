"""Generated gRPC stubs for ``proto/specsplit/v1/spec_decoding.proto``.

Do not edit: regenerate with ``python scripts/gen_stubs.py``.
"""
