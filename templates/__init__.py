"""flashgen's Jinja kernel templates, shipped as package data (`flashgen.templates`)."""
