"""The kopf operator that reconciles InferencePools (`kvflow operator`)."""
