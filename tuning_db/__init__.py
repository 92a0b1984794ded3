"""The tuning database shipped with flashgen (`flashgen.tuning_db`)."""
