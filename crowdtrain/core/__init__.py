"""The vocabulary every part shares: settings, wire schemas, status enums, Redis and object-storage
key names, the tensor and update codecs, the job spec and the model zoo. Imports nothing else of ours."""
