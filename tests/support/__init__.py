"""Helpers the tests share: tiny models built at test time, a real `pippin serve` to talk
to, engine runs, fake servers, parser harnesses and the one API-error assertion.

Imported as ``support.<module>``: the root conftest puts ``tests/`` on ``sys.path``.
"""
