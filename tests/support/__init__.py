"""Test helpers shared by the test modules (importable as ``support`` from any test directory: ``pyproject.toml``
puts ``tests/`` on pytest's ``pythonpath``): ``tiny_models`` (random-weight HF / GGUF models and their torch
references), ``fake_engine`` (``FakeEngine``, a model-free stand-in for ``LLMEngine`` behind the serving layer)."""
