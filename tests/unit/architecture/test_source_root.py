"""`platform/` is a source root, not a package (STYLE.md): an `__init__.py` there would make
`platform` a package that shadows the standard library module of that name (and breaks pytest)."""

from helpers.repo import REPO


def test_platform_is_a_source_root_without_init():
    assert not (REPO / "platform" / "__init__.py").exists()
    import platform

    assert hasattr(platform, "python_version")
