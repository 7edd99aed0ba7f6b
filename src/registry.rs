//! The component registry (DESIGN §3): graphs choose routers and executors by name, and programs
//! embedding kvflow add their own before loading a graph. (Drafters, offload stores and transfer
//! backends join it as they are built.)
//!
//! ```no_run
//! use kvflow::registry::Registry;
//! use kvflow_operators::policy::router::{RouteRequest, Router, RouterContext};
//!
//! struct AlwaysLast(usize);
//! impl Router for AlwaysLast {
//!     fn route(&mut self, _: &RouteRequest, outstanding: &[usize]) -> usize { outstanding.len() - 1 }
//! }
//! let mut registry = Registry::default();
//! registry.routers.register("always-last", |ctx: RouterContext| Box::new(AlwaysLast(ctx.ranks)) as Box<dyn Router>);
//! // then: Graph::load_with(path, &registry.names()) and runtime::run(&graph, &opts, &registry)
//! ```

use crate::graph::ComponentNames;
use kvflow_operators::policy::router::RouterRegistry;
use kvflow_operators::rank::Executor;

/// Everything a graph can name.
#[derive(Clone)]
pub struct Registry {
    pub routers: RouterRegistry,
    pub executors: Vec<(String, Executor)>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            routers: RouterRegistry::default(),
            executors: vec![("cpu".into(), Executor::Cpu), ("null".into(), Executor::Null)],
        }
    }
}

impl Registry {
    /// The names graphs are checked against.
    pub fn names(&self) -> ComponentNames {
        ComponentNames {
            executors: self.executors.iter().map(|(n, _)| n.clone()).collect(),
            routers: self.routers.names(),
        }
    }

    pub fn executor(&self, name: &str) -> Option<Executor> {
        self.executors.iter().find(|(n, _)| n == name).map(|(_, e)| *e)
    }
}
