"""A cluster member in a process of its own, for tests that kill it:
registers, prints "registered", then renews its lease until killed.

    python cluster_member_child.py ENDPOINT CLUSTER NODE_ID TTL
"""

import sys
import time

from cascade.cluster import EtcdClient, Membership

endpoint, cluster, node_id, ttl = sys.argv[1:5]
member = Membership(
    EtcdClient([endpoint], timeout=1.0), cluster, node_id, lease_ttl=int(ttl), refresh_seconds=0.2
)
if not member.start():
    sys.exit(f"not registered: {member.state()['last_error']}")
print("registered", flush=True)
deadline = time.monotonic() + 120  # a bound, should the test not kill it
while time.monotonic() < deadline:
    time.sleep(0.5)
