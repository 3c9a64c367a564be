"""Importing this module activates rlix-plugins in the importing process (if enabled).

For hosts that import a list of plugin modules in every process, e.g. veRL's
``VERL_USE_EXTERNAL_MODULES=rlix_plugins.autoload``. With ``RLIX_CONTROL_PLANE`` unset or
``off`` the import does nothing (no other variable is read); an invalid ``RLIX_CONTROL_PLANE``
raises :class:`~rlix_plugins.errors.SettingsError`.
"""

from rlix_plugins.activation import activate

ACTIVE = activate()
