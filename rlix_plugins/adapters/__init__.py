"""Pipeline-side drivers per framework; :mod:`.pipeline_coordinator` is shared by all."""
