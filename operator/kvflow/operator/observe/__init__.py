"""The planner's inputs: worker and router metrics turned into `planner.types.Observation`.

Pure parts (`exposition`, `histograms`, `observation`, `pods`) parse and compute; the I/O
shells (`scrape`, `prometheus`) only fetch text.
"""
