"""The session, config, CLI, composition table, errors, install and examples."""
