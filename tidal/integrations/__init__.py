"""tidal inside the trainers people use. Each integration is its own module, imported by
name (``tidal.integrations.trl``), so importing tidal never imports a trainer library."""
