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
//!
//! An executor is registered with an `ExecutorKind` (`kvflow_operators::executor`): it checks
//! its pool's `executor_settings` and builds one executor per rank.

use kvflow_operators::executor::ExecutorRegistry;
use kvflow_operators::policy::router::RouterRegistry;

/// Everything a graph can name.
#[derive(Clone, Default)]
pub struct Registry {
    pub routers: RouterRegistry,
    pub executors: ExecutorRegistry,
}

impl Registry {
    /// What graphs are checked against.
    pub fn names(&self) -> ComponentNames {
        ComponentNames {
            executors: self.executors.names(),
            routers: self.routers.names(),
            executor_kinds: self.executors.clone(),
        }
    }
}

/// The components a graph may choose from: those of the runtime's registry
/// (`kvflow::registry::Registry::names`), which programs embedding kvflow extend. Executors
/// also check their own `executor_settings`.
#[derive(Clone)]
pub struct ComponentNames {
    pub executors: Vec<String>,
    pub routers: Vec<String>,
    pub executor_kinds: kvflow_operators::executor::ExecutorRegistry,
}

impl ComponentNames {
    /// What kvflow registers itself (`Registry::default`).
    pub fn builtin() -> Self {
        Registry::default().names()
    }
}
