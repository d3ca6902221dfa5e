"""Result bundles: write (``BundleWriter``), verify (``verify_bundle``) and show (``show_bundle``).

The format is ``bundles/FORMAT.md``; nothing in this package imports torch.
"""

from verify.bundle.schema import SCHEMA_VERSION, BundleError, compute_verdict
from verify.bundle.show import LoadedBundle, load_bundle, show_bundle
from verify.bundle.verify import (
    VerifyReport,
    register_rescorer,
    render_report,
    unregister_rescorer,
    verify_bundle,
)
from verify.bundle.writer import (
    BundleWriter,
    Terminated,
    handle_sigterm,
    install_sigterm_handler,
    write_tarball,
)

__all__ = [
    "SCHEMA_VERSION", "BundleError", "BundleWriter", "LoadedBundle", "Terminated", "VerifyReport",
    "compute_verdict", "handle_sigterm", "install_sigterm_handler", "load_bundle", "register_rescorer",
    "render_report", "show_bundle", "unregister_rescorer", "verify_bundle", "write_tarball",
]
