"""Exit codes by which a process `baton up` started tells it why it stopped."""

from __future__ import annotations

# Its port is taken (EADDRINUSE is 98 on Linux): starting it again cannot help, so the
# supervisor stops the cluster and says why instead of restarting it.
ADDRESS_IN_USE = 98
