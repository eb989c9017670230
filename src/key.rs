//! The unit of work: the namespace and name of one MyResource.

use std::fmt;

use kube::ResourceExt;

use crate::resource::MyResource;

/// `namespace/name` of a MyResource; what the queues carry and the shards hash.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of a MyResource object.
    pub fn of(object: &MyResource) -> Self {
        ObjectKey::new(object.namespace().unwrap_or_default(), object.name_any())
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}
