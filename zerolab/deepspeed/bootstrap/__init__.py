"""Put on the ranks' PYTHONPATH by zerolab-deepspeed (launch.py): its sitecustomize installs the deepspeed alias."""
