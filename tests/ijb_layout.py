"""The small IJB-style layout of the IJB tests (see plsc.data.synthetic.generate_ijb)."""
from plsc.data.synthetic import generate_ijb


def make_layout(root, target="ijbc", num_identities=6, templates_per_identity=3, **kw):
    return generate_ijb(root, target, num_identities=num_identities, templates_per_identity=templates_per_identity,
                        face_size=48, crop_size=72, **kw)
