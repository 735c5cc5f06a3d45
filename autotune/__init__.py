"""autotune: measure diffusers configurations under a memory budget; load the fastest in production.

    import autotune
    profile = autotune.load_profile("sdxl-8GB.yaml")
    pipe = profile.load_pipeline()
"""

from .errors import AutotuneError, ModelError, ProfileError, SpaceError

# Raised when a knob's apply changes the state it makes: a profile written by another version says
# so when loaded (its software.autotune against this). 0.2.0: how an SDPA kernel is held under
# compile, and the GPU group offload's stream is made on, changed since 0.1.0 (2026-11-22).
__version__ = "0.2.0"

_PROFILE_NAMES = ("Profile", "ProfileMismatchWarning", "load_profile")


def __getattr__(name):
    # torch and diffusers load only when a profile is used, so `import autotune` stays cheap.
    if name in _PROFILE_NAMES:
        from . import profile

        return getattr(profile, name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


__all__ = ["AutotuneError", "ModelError", "ProfileError", "SpaceError", *_PROFILE_NAMES]
