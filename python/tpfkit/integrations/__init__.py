"""Our ops inside the models of OpenFold3, Boltz and Protenix, their packages unchanged on disk.

Each client module (`tpfkit.integrations.openfold3`, `.boltz`, `.protenix`) has enable(),
disable(), enabled() and disabled() (context managers) and is_enabled(). enable() puts tpfkit's
triangle attention and triangle multiplicative update where the client calls cuEquivariance's, and
makes its triangle layers take that path whatever its kernel switch says; models built before or
after are affected alike. It raises IntegrationError, naming the installed version, when a call
site it replaces is not where it expects it (supported: openfold3 0.5.0, boltz 2.2.1,
boltz-community 2.12.0, protenix 2.0.0). Importing this package imports no client.
"""
from tpfkit.integrations._patching import IntegrationError

__all__ = ["IntegrationError"]
